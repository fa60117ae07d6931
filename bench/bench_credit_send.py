"""Cost of the credit sender's hot path: ``CreditSender.send`` and the announcements that count
the sends back (``on_message``), this checkout's ``bus/credit.py`` against the one before the
sender remembered forgotten receivers and gave up lost messages (``--base``, read from git).

    python bench/bench_credit_send.py --quick     # ~1 s
    python bench/bench_credit_send.py             # more rounds and sends
    python bench/bench_credit_send.py --peers 64 --base <commit>

A real ROUTER on inproc and ``--peers`` DEALER receivers announcing plenty of free slots; per
round, ``--batch`` sends are timed, then every receiver reads what it got and announces its
count, and those announcements are timed as the sender handles them. The two versions run in
alternating rounds in the same process, so load on the machine hits both alike; the figures
are medians over rounds, per message, and the ratio new / old.
"""
from __future__ import annotations

import argparse
import statistics
import subprocess
import sys
import time
import types
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import zmq  # noqa: E402

from rolloutd.bus import codec  # noqa: E402
from rolloutd.bus.messages import PROTOCOL_VERSION  # noqa: E402

BASE = "b6c67dd"  # the last commit with the sender that forgot in-flight messages


def load_old(base: str) -> types.ModuleType | None:
    """The old module from git, or None when this checkout does not have it (a shallow clone)."""
    try:
        src = subprocess.run(["git", "-C", str(REPO), "show", f"{base}:bus/credit.py"], check=True,
                             capture_output=True, text=True).stdout
    except (OSError, subprocess.CalledProcessError):
        return None
    mod = types.ModuleType("credit_old")
    exec(compile(src, f"{base}:bus/credit.py", "exec"), mod.__dict__)
    return mod


class Rig:
    def __init__(self, ctx, mod, peers: int, name: str):
        router = ctx.socket(zmq.ROUTER)
        router.setsockopt(zmq.SNDHWM, 0)
        router.bind(f"inproc://credit-{name}")
        self.tx = mod.CreditSender(router)
        self.dealers = []
        self.counts = []
        for i in range(peers):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.RCVHWM, 0)
            d.setsockopt(zmq.IDENTITY, f"init@n{i}#1".encode())
            d.connect(f"inproc://credit-{name}")
            self.dealers.append(d)
            self.counts.append(0)
        self.announce()
        self.handle()

    def announce(self):
        for d, n in zip(self.dealers, self.counts):
            d.send(codec.pack({"v": PROTOCOL_VERSION, "kind": "ready", "free": 10**9, "received": n,
                               "info": {"node": "n"}}))

    def handle(self) -> float:
        """Receive every receiver's announcement; the time spent in ``on_message`` only."""
        spent = 0.0
        for _ in self.dealers:
            assert self.tx.sock.poll(5000), "an announcement did not arrive"
            frames = self.tx.sock.recv_multipart(copy=False)
            t0 = time.perf_counter()
            assert self.tx.on_message(frames)
            spent += time.perf_counter() - t0
        return spent

    def round(self, batch: int, frame: bytes) -> tuple[float, float]:
        send = self.tx.send
        t0 = time.perf_counter()
        for _ in range(batch):
            send([frame])
        t_send = time.perf_counter() - t0
        for i, d in enumerate(self.dealers):  # read it all, then announce the counts
            while d.poll(0):
                d.recv_multipart(copy=False)
                self.counts[i] += 1
        assert sum(self.counts) == (self.rounds + 1) * batch, "a send was lost"
        self.rounds += 1
        self.announce()
        return t_send / batch, self.handle() / batch

    rounds = 0

    def close(self):
        for d in self.dealers:
            d.close(linger=0)
        self.tx.sock.close(linger=0)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer rounds and sends (~1 s)")
    ap.add_argument("--peers", type=int, default=8, help="receivers (default 8)")
    ap.add_argument("--batch", type=int, default=None, help="sends per round (default 5000, quick 2000)")
    ap.add_argument("--rounds", type=int, default=None, help="rounds per version (default 40, quick 10)")
    ap.add_argument("--base", default=BASE, help=f"git revision of the old bus/credit.py (default {BASE})")
    a = ap.parse_args()
    batch = a.batch or (2000 if a.quick else 5000)
    rounds = a.rounds or (10 if a.quick else 40)
    from rolloutd.bus import credit as new
    old = load_old(a.base)
    if old is None:
        print(f"!! {a.base}:bus/credit.py is not in this checkout (shallow clone?): new code only, no ratio")
    ctx = zmq.Context()
    frame = codec.pack({"kind": "job", "job_id": "x" * 16, "attempt": 1, "instance": {"p": "y" * 200}})
    rigs = {"new": Rig(ctx, new, a.peers, "new")}
    if old is not None:
        rigs["old"] = Rig(ctx, old, a.peers, "old")
    res = {k: ([], []) for k in rigs}
    try:
        for r in range(rounds):
            order = list(rigs.items())
            for k, rig in (order if r % 2 else order[::-1]):  # alternate: machine load hits both alike
                s, h = rig.round(batch, frame)
                res[k][0].append(s)
                res[k][1].append(h)
    finally:
        for rig in rigs.values():
            rig.close()
        ctx.term()
    med = {k: (statistics.median(v[0]) * 1e6, statistics.median(v[1]) * 1e6) for k, v in res.items()}
    print(f"credit sender, {a.peers} receivers, {rounds} rounds x {batch} sends per version (medians per message)")
    for i, what in enumerate(("send:        ", "counted back:")):
        n = med["new"][i]
        if "old" in med:
            o = med["old"][i]
            print(f"  {what}   old {o:.4f} us   new {n:.4f} us   new/old {n / o:.3f}")
        else:
            print(f"  {what}   new {n:.4f} us")
    print(f"  (announcements handled: one per receiver per round; 'counted back' is their cost per message sent)")


if __name__ == "__main__":
    main()
