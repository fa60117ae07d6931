"""Smoke-run every benchmark's ``--quick`` mode so none of them rots (``make bench-smoke``, CI).

Figures printed here are not results: a smoke run only proves each benchmark still runs to its
end. So they run ``--jobs`` at a time (30 quick runs: 650 s one at a time, ~400 s two at a time
in CI), each one's output printed whole when it ends, with its time. Exit 1 when any failed, naming them.

    python bench/smoke.py [--jobs 2] [bench/bench_x.py ...]
"""
from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

HERE = Path(__file__).resolve().parent
# Started first so the longest runs do not end up alone at the end (their --quick took 40-75 s
# in CI; the others take 1-25 s).
SLOWEST_FIRST = ("bench_vllm_api.py", "bench_vllm_neighbour.py", "bench_endpoint.py",
                 "bench_endpoint_isolation.py", "bench_control_plane.py", "bench_pipeline.py", "bench_harness.py")
TIMEOUT_S = 900  # one quick run; a hang fails the smoke instead of the CI's budget


def ordered(paths: list[Path]) -> list[Path]:
    rank = {name: i for i, name in enumerate(SLOWEST_FIRST)}
    return sorted(paths, key=lambda p: (rank.get(p.name, len(rank)), p.name))


def run_one(path: Path, env: dict) -> tuple[Path, int, float, str]:
    t0 = time.monotonic()
    # Its own session: on a timeout the whole group goes, daemons the bench started included.
    p = subprocess.Popen([sys.executable, str(path), "--quick"], env=env, stdout=subprocess.PIPE,
                         stderr=subprocess.STDOUT, text=True, errors="replace", start_new_session=True)
    try:
        out, _ = p.communicate(timeout=TIMEOUT_S)
        rc = p.returncode
    except subprocess.TimeoutExpired:
        os.killpg(p.pid, signal.SIGKILL)
        out, _ = p.communicate()
        rc, out = -1, (out or "") + f"\n(timed out after {TIMEOUT_S} s)\n"
    return path, rc, time.monotonic() - t0, out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--jobs", type=int, default=2, help="quick runs at a time (default 2)")
    ap.add_argument("benches", nargs="*", type=Path, help="default: every bench/bench_*.py")
    a = ap.parse_args(argv)
    if a.jobs < 1:
        ap.error("--jobs must be at least 1")
    paths = ordered([p.resolve() for p in a.benches] or sorted(HERE.glob("bench_*.py")))
    failed: list[str] = []
    t0 = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="rd-bench-img-") as img:
        # Plots of quick runs go to a scratch dir, never over the documented ones (bench/common.py).
        env = dict(os.environ, ROLLOUTD_BENCH_IMG_DIR=img)
        with ThreadPoolExecutor(a.jobs) as pool:
            for path, rc, took, out in pool.map(lambda p: run_one(p, env), paths):
                print(f"== bench/{path.name} --quick", flush=True)
                print(out, end="" if out.endswith("\n") or not out else "\n", flush=True)
                print(f"== {path.name} --quick took {took:.0f} s, exit {rc}", flush=True)
                if rc != 0:
                    failed.append(path.name)
    print(f"== {len(paths)} quick runs, {a.jobs} at a time, in {time.monotonic() - t0:.0f} s; "
          f"failed: {', '.join(failed) or 'none'}", flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
