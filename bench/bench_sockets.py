"""A non-blocking send and receive on a zmq.asyncio socket: through its Future (first before), on
its synchronous shadow with pyzmq's ``send_multipart`` / ``recv_multipart`` (second before), and
as ``bus.sockets.send_now`` / ``recv_now`` do now (the shadow, one frame at a time with plain int
flags), same run.

    python bench/bench_sockets.py            # 7 repeats of 20,000 messages each way
    python bench/bench_sockets.py --quick    # 3 repeats of 5,000

Every daemon's hot path is non-blocking sends and drains (the router's replies and ``backend.load``
events, the gateway's replies and hand-offs, every event published). zmq.asyncio wraps even an
immediate result in a Future; its own sync shadow does the same work without it. A PUSH/PULL pair
over ipc inside one event loop; ``time.process_time`` counts both ends and libzmq's I/O thread.
The ways alternate repeat by repeat; medians. A message is two frames (a topic and a body, as
an event, or a ROUTER's identity and a job).
"""
from __future__ import annotations

import argparse
import asyncio
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common

import zmq
import zmq.asyncio

from rolloutd.bus.sockets import _events, _sync, recv_now, send_now


def _send_future(sock, frames):  # bus.sockets.send_now before: the asyncio socket's own send
    try:
        sock.send_multipart(frames, zmq.NOBLOCK, copy=False).result()
        return True
    except zmq.Again:
        return False


def _recv_future(sock):  # bus.sockets.recv_now before
    if not sock.getsockopt(zmq.EVENTS) & zmq.POLLIN:
        return None
    try:
        return sock.recv_multipart(zmq.NOBLOCK, copy=False).result()
    except zmq.Again:
        return None


def _send_multipart(sock, frames):  # bus.sockets.send_now before 2026-12-07
    try:
        sock._shadow_sock.send_multipart(frames, zmq.NOBLOCK, copy=False)
        return True
    except zmq.Again:
        return False


def _recv_multipart(sock):  # bus.sockets.recv_now before 2026-12-07
    sync = _sync(sock)
    if not _events(sock, sync) & zmq.POLLIN:
        return None
    try:
        return sync.recv_multipart(zmq.NOBLOCK, copy=False)
    except zmq.Again:
        return None


async def measure(n: int, repeats: int) -> dict:
    ctx = zmq.asyncio.Context()
    d = common.short_tmpdir("bench-sockets-")
    push, pull = ctx.socket(zmq.PUSH), ctx.socket(zmq.PULL)
    for s in (push, pull):
        s.setsockopt(zmq.LINGER, 0)
    push.setsockopt(zmq.SNDHWM, 0)
    pull.setsockopt(zmq.RCVHWM, 0)
    push.bind(f"ipc://{d}/s")
    pull.connect(f"ipc://{d}/s")
    frames = [b"run.leases", b"x" * 200]
    while not send_now(push, frames):  # connected (a PUSH without a peer refuses)
        await asyncio.sleep(0.01)
    while recv_now(pull) is None:
        await asyncio.sleep(0.01)
    ways = {"future": (_send_future, _recv_future), "multipart": (_send_multipart, _recv_multipart),
            "now": (send_now, recv_now)}
    out = {k: {"send": [], "recv": []} for k in ways}
    try:
        for _ in range(repeats):
            for name, (send, recv) in ways.items():
                c0, sent = time.process_time(), 0
                for _ in range(n):
                    sent += send(push, frames)
                out[name]["send"].append((time.process_time() - c0) / n * 1e6)
                assert sent == n, f"{name}: {n - sent} of {n} sends refused"
                got, c0 = 0, time.process_time()
                while got < n:
                    if recv(pull) is not None:
                        got += 1
                    else:
                        await asyncio.sleep(0)
                out[name]["recv"].append((time.process_time() - c0) / n * 1e6)
    finally:
        push.close()
        pull.close()
        ctx.term()
    return {k: {op: common.median(v) for op, v in ops.items()} for k, ops in out.items()}


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    a = ap.parse_args()
    n, repeats = (5000, 3) if a.quick else (20000, 7)
    print(f"non-blocking send/recv on a zmq.asyncio socket, {n:,} messages x {repeats} repeats, tree "
          f"{common.revision(common.REPO)}, {common.machine()}, load {common.loadavg()}", flush=True)
    r = asyncio.run(measure(n, repeats))
    for op in ("send", "recv"):
        fut, multi, now = r["future"][op], r["multipart"][op], r["now"][op]
        print(f"  {op}: through the Future {fut:.2f} us, on the sync shadow with pyzmq's {op}_multipart "
              f"{multi:.2f} us, now {now:.2f} us -> {now / fut:.2f}x and {now / multi:.2f}x")


if __name__ == "__main__":
    main()
