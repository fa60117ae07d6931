#!/usr/bin/env python3
"""What one job's abuse of its harness endpoint costs the other jobs (issue 31).

Same run: a *server* process hosts one ``EndpointSession`` + uvicorn per job on Unix sockets
in one event loop, exactly as the run daemon hosts them (``make_app``/``serve``, default
``EndpointBounds``), over a scripted vLLM-API backend in its own process (``echo``, zero
latency). ``--neighbours`` well-behaved clients (this process, threads; small multi-turn chat
calls sent back unchanged) call their own jobs' endpoints through every phase: quiet first, then
with one attacker process per phase against another job's endpoint through the stdlib TCP relay
the sandbox uses (``sandbox.toolserver.relay.Relay``), running the attacks of
tests/harness/isolation_agents.py: ``big8`` (8 MB body), ``big60`` (60 MB), ``nested``
(200k ``[``), ``conns`` (10,000 connections), ``slow`` (slowloris headers and body, HTTP/0.9, a
2 MiB header line, HTTP/7.0), ``noread`` (64 replies never read).

Phases: quiet, each attack, quiet again (the machine's own drift). Per phase: neighbour latency p50/p99/max and its ratio to the quiet p99, the server's largest
event-loop lag (a 10 ms ticker in the server) and its peak RSS. Example::

    python bench/bench_endpoint_isolation.py --quick
    python bench/bench_endpoint_isolation.py --phase-s 10 --repeats 3 --baseline-rev 7ca5d4b
"""
from __future__ import annotations

import argparse
import json
import os
import queue
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from bench_agent_loop import ROOT, tokenizer_dir  # noqa: E402
from common import cpu_seconds, die_with_parent, loadavg, median, percentile, pyspy_report, pyspy_start, revision, short_tmpdir  # noqa: E402

sys.path.insert(0, str(ROOT))
from tests.harness.isolation_agents import ATTACKER  # noqa: E402

ATTACKS = ("big8", "big60", "nested", "conns", "slow", "noread")

SERVER = r"""
import asyncio, json, os, sys, time
import rolloutd.endpoint.session
from rolloutd.llm.client import LLMClient, simple_generate
from rolloutd.endpoint.app import make_app
from rolloutd.endpoint.bounds import EndpointLimits
from rolloutd.endpoint.server import serve
from rolloutd.endpoint.session import EndpointSession
from rolloutd.llm.tokenizer_utils import load_tokenizer
tok_dir, backend, d, n, max_context = sys.argv[1], sys.argv[2], sys.argv[3], int(sys.argv[4]), int(sys.argv[5])

async def main():
    tok = load_tokenizer(tok_dir)
    client = LLMClient(backend)
    servers = []
    for i in range(n):
        s = EndpointSession(simple_generate(client, "b", 0), tok, limits=EndpointLimits(max_context=max_context),
                            api_key="k")
        await s.max_body()
        servers.append(await serve(make_app(s), uds=f"{d}/job{i}.sock"))
    print("READY", rolloutd.endpoint.session.__file__, flush=True)
    lag = 0.0
    while True:  # the loop's lag: how late a 10 ms sleep wakes up; reported (max) every 0.25 s
        t_end = time.monotonic() + 0.25
        while time.monotonic() < t_end:
            t = time.monotonic()
            await asyncio.sleep(0.01)
            lag = max(lag, time.monotonic() - t - 0.01)
        rss = hwm = 0
        for line in open("/proc/self/status"):
            if line.startswith("VmRSS:"):
                rss = int(line.split()[1]) / 1024
            elif line.startswith("VmHWM:"):
                hwm = int(line.split()[1]) / 1024
        print("STAT", json.dumps({"lag": round(lag, 4), "rss": round(rss, 1), "hwm": round(hwm, 1)}), flush=True)
        lag = 0.0

asyncio.run(main())
"""

RELAYED_ATTACKER = r"""
import os, sys
from rolloutd.sandbox.toolserver.relay import Relay
r = Relay(sys.argv[1]); port = r.start()
os.environ["OPENAI_BASE_URL"] = "http://127.0.0.1:%d/v1" % port
os.environ["OPENAI_API_KEY"] = "k"
sys.argv = ["attack", sys.argv[2]]
code = open(os.environ["ATTACK_FILE"]).read()
exec(compile(code, "attack", "exec"))
"""


def lines_of(proc) -> queue.Queue:
    q: queue.Queue = queue.Queue()
    threading.Thread(target=lambda: [q.put(ln) for ln in proc.stdout], daemon=True).start()
    return q


def wait_line(q: queue.Queue, prefix: str, proc, timeout_s: float = 120.0) -> str:
    end = time.monotonic() + timeout_s
    while time.monotonic() < end:
        try:
            ln = q.get(timeout=1.0)
        except queue.Empty:
            if proc.poll() is not None:
                break
            continue
        if ln.startswith(prefix):
            return ln
    raise RuntimeError(f"no {prefix} line")


def neighbour(sock: str, stop: threading.Event, out: list):
    """Small chat calls, history sent back unchanged; (time, latency) per call."""
    import httpx

    msgs = [{"role": "system", "content": "You are terse."}, {"role": "user", "content": "hello"}]
    with httpx.Client(transport=httpx.HTTPTransport(uds=sock), base_url="http://x/v1", timeout=300,
                      headers={"Authorization": "Bearer k"}) as c:
        i = 0
        while not stop.is_set():
            t = time.perf_counter()
            r = c.post("/chat/completions", json={"model": "m", "messages": msgs, "max_tokens": 4})
            lat = time.perf_counter() - t
            if r.status_code != 200:
                raise RuntimeError(f"neighbour call failed: {r.status_code} {r.text[:200]}")
            out.append((time.monotonic(), lat))
            msgs.append(r.json()["choices"][0]["message"])
            msgs.append({"role": "user", "content": f"again {i}"})
            if len(msgs) > 24:
                msgs = msgs[:2]
            i += 1
            time.sleep(0.05)


def start_server(tok_dir, backend: str, d: Path, n: int, max_context: int, env: dict):
    d.mkdir(parents=True, exist_ok=True)
    srv = subprocess.Popen([sys.executable, "-c", SERVER, str(tok_dir), backend, str(d), str(n), str(max_context)],
                           stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env, cwd=str(d),
                           preexec_fn=die_with_parent)
    sq = lines_of(srv)  # cwd: not the checkout, whose rolloutd/ would come before PYTHONPATH
    print(f"# {d.name}: {wait_line(sq, 'READY', srv).split()[1]}")
    stats: list[tuple[float, dict]] = []

    def collect():
        while srv.poll() is None:
            try:
                ln = sq.get(timeout=1.0)
            except queue.Empty:
                continue
            if ln.startswith("STAT {"):
                try:
                    stats.append((time.monotonic(), json.loads(ln[5:])))
                except ValueError:  # a log line interleaved
                    pass

    threading.Thread(target=collect, daemon=True).start()
    return srv, stats


def run_phase(a, d: Path, n: int, phase: str, stats: list, env: dict, prof: Path | None) -> dict:
    """Neighbours on jobs 0..n-2 of the server in ``d`` (started for this phase), the attacker
    (if any) on job n-1; the neighbours run 1 s before the phase's window opens."""
    stop = threading.Event()
    lat: list = []
    ths = [threading.Thread(target=neighbour, args=(str(d / f"job{i}.sock"), stop, lat), daemon=True)
           for i in range(a.neighbours)]
    for t in ths:
        t.start()
    time.sleep(1.0)
    t0 = time.monotonic()
    cpu0 = cpu_seconds(a.server_pid[d.name])
    atk = spy = None
    if phase != "quiet":
        atk = subprocess.Popen([sys.executable, "-c", RELAYED_ATTACKER, str(d / f"job{n - 1}.sock"), phase],
                               stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                               env=dict(env, ATTACK_FILE=str(d.parent / "attack.py")), preexec_fn=die_with_parent)
    if prof is not None:
        spy = pyspy_start({f"{d.name}-{phase}": a.server_pid[d.name]}, a.phase_s - 0.5, prof)
    time.sleep(a.phase_s)
    t1 = time.monotonic()
    cpu = cpu_seconds(a.server_pid[d.name]) - cpu0
    out = ""
    atk_cpu = float("nan")  # the attacker's own CPU (with its relay threads), if it still runs
    if atk is not None:
        if atk.poll() is None:
            atk_cpu = cpu_seconds(atk.pid)
            atk.send_signal(signal.SIGKILL)
        out = atk.communicate(timeout=30)[0]
    stop.set()
    for t in ths:
        t.join(30)
    if spy:
        for name, r in pyspy_report(spy, top=25).items():
            print(f"## py-spy {name}: {r['samples']} samples; self:")
            for share, f in r["self"]:
                print(f"  {share:6.1%} {f}")
    xs = [x for t, x in lat if t0 <= t <= t1]
    st = [s for t, s in stats if t0 <= t <= t1 + 0.3]
    ans = [ln for ln in out.splitlines() if ln.startswith(("ANSWER", "OPENED", "CLOSED"))]
    return {"calls": len(xs), "p50_ms": percentile(xs, 50) * 1000, "p99_ms": percentile(xs, 99) * 1000,
            "max_ms": max(xs) * 1000 if xs else float("nan"),
            "loop_lag_ms": max((s["lag"] for s in st), default=float("nan")) * 1000,
            "rss_mb": max((s["rss"] for s in st), default=float("nan")),
            "hwm_mb": max((s["hwm"] for s in st), default=float("nan")), "attacker": ans[:6],
            "server_cpu": cpu / (t1 - t0), "attacker_cpu_s": atk_cpu}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--neighbours", type=int, default=4)
    ap.add_argument("--phase-s", type=float, default=15.0)
    ap.add_argument("--repeats", type=int, default=1, help="rounds of (quiet, each attack); medians reported")
    ap.add_argument("--attacks", default=",".join(ATTACKS))
    ap.add_argument("--baseline-rev", default=None,
                    help="also serve with this git revision's code (git archive, first on PYTHONPATH); every "
                         "phase runs on both servers in turn (before/after in one run)")
    ap.add_argument("--profile", default=None, help="py-spy the server through phases of these names (comma list)")
    ap.add_argument("--tokenizer", default="auto", help="auto | qwen | tiny")
    ap.add_argument("--max-context", type=int, default=16384)
    ap.add_argument("--quick", action="store_true", help="3 s phases, one repeat")
    a = ap.parse_args()
    if a.quick:
        a.phase_s, a.repeats = 3.0, 1
    tok_dir, tok_name = tokenizer_dir(a.tokenizer)
    d = short_tmpdir("bei-")
    env = dict(os.environ, PYTHONPATH=str(ROOT) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    procs = []
    variants: dict[str, tuple[Path, list]] = {}
    a.server_pid = {}
    attacks = a.attacks.split(",")
    profiled = set((a.profile or "").split(","))
    try:
        be = subprocess.Popen([sys.executable, "-m", "rolloutd.backends.scripted", "--port", "0", "--tokenizer",
                               str(tok_dir), "--policy", "echo", "--latency", "constant:0"],
                              stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True, env=env,
                              preexec_fn=die_with_parent)
        procs.append(be)
        port = int(wait_line(lines_of(be), "READY", be).split()[1])
        n = a.neighbours + 1
        if a.baseline_rev:
            base = d / "code"
            base.mkdir()
            tar = subprocess.run(["git", "-C", str(ROOT), "archive", "--prefix=rolloutd/", a.baseline_rev],
                                 check=True, capture_output=True).stdout
            subprocess.run(["tar", "-x", "-C", str(base)], input=tar, check=True)
            # base/rolloutd is that revision's checkout (no __init__.py at its top): without the
            # checkout on the path it imports as a namespace package, its subfolders as rolloutd.*
            benv = dict(env, PYTHONPATH=str(base))
            srv, stats = start_server(tok_dir, f"http://127.0.0.1:{port}", d / "before", n, a.max_context, benv)
            procs.append(srv)
            variants["before"] = (d / "before", stats)
            a.server_pid["before"] = srv.pid
        name = "after" if a.baseline_rev else "now"
        srv, stats = start_server(tok_dir, f"http://127.0.0.1:{port}", d / name, n, a.max_context, env)
        procs.append(srv)
        variants[name] = (d / name, stats)
        a.server_pid[name] = srv.pid
        (d / "attack.py").write_text(ATTACKER)
        for vd, st in variants.values():  # warm-up (first renders, imports on first use)
            w = argparse.Namespace(**{**vars(a), "phase_s": 3.0})
            run_phase(w, vd, n, "quiet", st, env, None)
        rows: dict[tuple[str, str], list[dict]] = {}
        order = list(variants)
        plan = [(r, ph) for r in range(a.repeats) for ph in ["quiet"] + attacks] + [(a.repeats, "quiet")]
        for k, (rep, phase) in enumerate(plan):
            for v in (order if k % 2 == 0 else order[::-1]):  # alternate which variant goes first
                vd, st = variants[v]
                prof = d / "prof" if phase in profiled and rep == 0 else None
                rows.setdefault((v, phase), []).append(run_phase(a, vd, n, phase, st, env, prof))
                time.sleep(1.0)
    finally:
        for p in procs:
            if p.poll() is None:
                p.terminate()
                try:
                    p.wait(10)
                except subprocess.TimeoutExpired:
                    p.kill()
        subprocess.run(["rm", "-rf", str(d)], check=False)
    print(f"# bench_endpoint_isolation: {a.neighbours} neighbours, {a.phase_s:g} s per phase, {a.repeats} repeats, "
          f"{tok_name}, max_context {a.max_context}; rev {revision(ROOT)}"
          + (f", before = {a.baseline_rev}" if a.baseline_rev else "") + f"; load {loadavg()}")
    print("p99 and p50: median over the repeats [min-max]; p99 / quiet: against the median p99 of all that "
          "server's quiet phases; lag, RSS: max over the repeats")
    print("| server | phase | calls (median) | p50 ms | p99 ms [min-max] | p99 / quiet | max ms | "
          "loop lag max ms | server CPU (cores) | attacker CPU s | RSS MB (peak) |")
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for v in order:
        q = median(r["p99_ms"] for r in rows[(v, "quiet")])
        for phase in ["quiet"] + attacks:
            rs = rows[(v, phase)]
            p99s = [r["p99_ms"] for r in rs]
            print(f"| {v} | {phase} | {median(r['calls'] for r in rs):.0f} | {median(r['p50_ms'] for r in rs):.1f} | "
                  f"{median(p99s):.1f} [{min(p99s):.0f}-{max(p99s):.0f}] | {median(p99s) / q:.2f} | "
                  f"{max(r['max_ms'] for r in rs):.0f} | {max(r['loop_lag_ms'] for r in rs):.0f} | "
                  f"{median(r['server_cpu'] for r in rs):.2f} | {median(r['attacker_cpu_s'] for r in rs):.1f} | "
                  f"{max(r['rss_mb'] for r in rs):.0f} ({max(r['hwm_mb'] for r in rs):.0f}) |")
        qs = [r["p99_ms"] for r in rows[(v, "quiet")]]
        print(f"  {v}: quiet p99 over {len(qs)} phases: {', '.join(f'{x:.0f}' for x in qs)} ms "
              f"(max/min {max(qs) / min(qs):.2f})")
        for phase in attacks:
            print(f"  {v} {phase}: {'; '.join(rows[(v, phase)][0]['attacker'])}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
