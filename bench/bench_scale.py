"""Scale-out (issue 16): throughput of N simulated worker nodes against N x the one-node figure.

    python bench/bench_scale.py --quick        # N = 1, 2; under a minute (CI's smoke run)
    python bench/bench_scale.py                # N = 1, 2, 4, 8, 16
    python bench/bench_scale.py --nodes 1,2,4,8 --pool 8 --call-s 3 --json out.json

One head (events, router, gateway) and N worker nodes, each with its own init, run and eval
daemons, node name and runtime directory, all started with the invocation the Slurm launcher
(systemd/slurm/rolloutd-slurm.sh, ``cmd_node``) makes: ``rolloutd <daemon> --set node=<name>
--set endpoints.head=<addr> --set endpoints.base_port=<port> --set endpoints.runtime_dir=<dir>``,
over tcp on loopback. Nodes are added to the same head as N grows (1, then 2, 4, ...), so the
one-node figure and every N share the run, the head and the machine's load.

Each node has one node-local scripted vLLM-API backend (``rolloutd.backends.scripted``, registered with
``node=<name>``; ``router.node_affinity`` keeps a node's jobs on it) whose per-call latency grows
with its own requests in flight: ``call_s x (1 + slope x running)``, as a real engine slows down
with its batch. Jobs are ``synthetic_llm`` with ``llm_calls`` calls: seconds of simulated LLM time
and milliseconds of daemon CPU each, so the figure measures the control plane, not this machine.

Per N: a closed batch of ``N x pool x rounds`` jobs; throughput = completions per second between
the 10% and 90% quantiles of the client's arrival times (fill and drain left out); efficiency =
throughput / (N x one-node throughput); head CPU (events + router + gateway, /proc) per job and
per node per second over the batch.
"""
from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
import common
from bench_control_plane import Head, free_port_block


class LoadLatency:
    """A backend's per-call latency grows with its own requests in flight (batching slows each)."""

    def __init__(self, base_s: float, slope: float, backend):
        self.base_s, self.slope, self.backend = base_s, slope, backend

    def sample(self, rng, n_tokens: int) -> float:
        return self.base_s * (1.0 + self.slope * max(0, self.backend.num_running - 1))


class Node:
    """init, run and eval of one simulated node, as the launcher's ``cmd_node`` starts them."""

    def __init__(self, name: str, head: Head, root: Path, sets: dict):
        self.name = name
        self.runtime = head.tmp / name
        self.procs: dict[str, subprocess.Popen] = {}
        self.logs: list = []
        args = ["--set", f"node={name}", "--set", "endpoints.head=127.0.0.1",
                "--set", f"endpoints.base_port={head.port}", "--set", f"endpoints.runtime_dir={self.runtime}"]
        for k, v in sets.items():
            args += ["--set", f"{k}={v}"]
        env, cwd = common.source_env(root)
        self.runtime.mkdir(parents=True, exist_ok=True)
        for d in ("eval", "run", "init"):  # the launcher's order
            self.procs[d] = subprocess.Popen([sys.executable, "-m", "rolloutd.daemons.cli", d, *args], cwd=cwd,
                                             env=env, stdin=subprocess.DEVNULL,
                                             stdout=self._log(d), stderr=subprocess.STDOUT,
                                             preexec_fn=common.die_with_parent)

    def _log(self, daemon: str):
        f = open(self.runtime / f"{daemon}.log", "w")  # noqa: SIM115 - the daemon's stdout until stop()
        self.logs.append(f)
        return f

    def stop(self):
        common.stop_procs(list(self.procs.values()), self.logs, wait_s=20)


def wait_nodes(client, names: set, timeout_s: float = 300.0):
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline:
        seen = {(d.get("daemon"), d.get("node")) for d in client.status().get("daemons", [])}
        if all((p, n) in seen for n in names for p in ("init", "run", "eval")):
            return
        time.sleep(0.5)
    raise TimeoutError(f"nodes {sorted(names)} did not all report within {timeout_s}s")


def batch(client, n_nodes: int, a) -> tuple[list[float], int]:
    jobs = n_nodes * a.pool * a.rounds
    inst = {"llm_calls": a.calls, "max_tokens": 4, "prompt_len": 16}
    t0 = time.monotonic()
    ids = client.submit([{"handler": "synthetic_llm", "instance": inst, "n": min(4096, jobs)}])
    arrivals, bad = [], 0
    want = set(ids)
    deadline = t0 + a.timeout
    while want and time.monotonic() < deadline:
        for r in client.poll(wait_s=1.0, max_results=1024):
            if r["job_id"] in want:
                want.discard(r["job_id"])
                arrivals.append(time.monotonic() - t0)
                bad += r["status"] != "ok"
    return arrivals, bad + len(want)


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true")
    ap.add_argument("--nodes", default=None, help="comma list, increasing (default 1,2,4,8,16; quick 1,2)")
    ap.add_argument("--pool", type=int, default=None, help="run.pool per node (default 8; quick 4)")
    ap.add_argument("--calls", type=int, default=2, help="LLM calls per job")
    ap.add_argument("--call-s", type=float, default=None, help="per-call latency at one request in flight")
    ap.add_argument("--slope", type=float, default=0.05, help="latency growth per extra request in flight")
    ap.add_argument("--rounds", type=int, default=None, help="jobs per run slot per batch")
    ap.add_argument("--timeout", type=float, default=600.0)
    ap.add_argument("--root", default=str(common.REPO))
    ap.add_argument("--json", default=None)
    ap.add_argument("--plot", default=None, help="PNG path (default docs/img/scale_efficiency.png unless --quick)")
    a = ap.parse_args()
    sizes = [int(x) for x in (a.nodes or ("1,2" if a.quick else "1,2,4,8,16")).split(",")]
    a.pool = a.pool or (4 if a.quick else 8)
    a.call_s = a.call_s or (1.5 if a.quick else 3.0)
    a.rounds = a.rounds or (3 if a.quick else 4)

    import structlog
    from rolloutd.gateway.client import RolloutClient
    from rolloutd.backends.scripted import ScriptedBackend
    from rolloutd.backends.tiny_model import build_tiny_tokenizer

    structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))
    print(f"scale: N = {sizes}, run.pool {a.pool}, {a.calls} calls x {a.call_s} s (+{a.slope:.0%} per request in "
          f"flight), {a.rounds} jobs per slot, tree {common.revision(a.root)}, {common.machine()}, "
          f"load {common.loadavg()}", flush=True)
    node_sets = {"run.pool": a.pool, "init.pool": a.pool, "eval.pool": a.pool, "logging.level": "warning",
                 "sandbox.runtime": "local"}
    head = Head(Path(a.root), free_port_block(), {"router.node_affinity": 1.0, "run.pool": a.pool}).start()
    tok = build_tiny_tokenizer()
    nodes: list[Node] = []
    backends = []
    rows = []
    try:
        client = RolloutClient(head.addr("gateway"), timeout_s=30.0)
        for n in sizes:
            while len(nodes) < n:
                name = f"node{len(nodes):02d}"
                b = ScriptedBackend(tok, policy="constant:text=ok")
                b.latency = LoadLatency(a.call_s, a.slope, b)
                b.start()
                backends.append(b)
                client.add_backend(b.url, node=name)
                nodes.append(Node(name, head, Path(a.root), node_sets))
            wait_nodes(client, {x.name for x in nodes})
            meter = common.CpuMeter(head.pids()).start()
            arrivals, bad = batch(client, n, a)
            meter.stop()
            rate = common.steady_rate(arrivals)
            head_cpu = sum(meter.result.values())
            row = {"nodes": n, "jobs": len(arrivals), "failed_or_missing": bad, "rate": rate,
                   "makespan_s": max(arrivals) if arrivals else float("nan"), "head_cpu_s": head_cpu,
                   "head_cpu_ms_per_job": 1000 * head_cpu / max(1, len(arrivals)),
                   "head_cpu_per_node_s": head_cpu / meter.wall / n, "cpu": meter.result, "load": common.loadavg()}
            rows.append(row)
            base = rows[0]["rate"]
            row["efficiency"] = rate / (n * base) if base else float("nan")
            print(f"  N={n:>2}: {rate:6.2f} jobs/s steady ({len(arrivals)} jobs, {bad} failed/missing, makespan "
                  f"{row['makespan_s']:.1f} s), {row['efficiency']:.3f} of {n} x one node | head CPU "
                  f"{row['head_cpu_ms_per_job']:.1f} ms/job, {row['head_cpu_per_node_s']:.2%} of a core per node "
                  f"| load {row['load']}", flush=True)
        client.close()
    finally:
        for x in nodes:
            x.stop()
        head.stop()
        for b in backends:
            b.stop()
    if a.json:
        Path(a.json).write_text(json.dumps({"rows": rows, "args": vars(a)}, indent=1))
    plot = a.plot or (None if a.quick else str(common.IMG_DIR / "scale_efficiency.png"))
    if plot and rows:
        plt = common.plt()
        fig, ax = plt.subplots(1, 2, figsize=(9, 3.6))
        ns = [r["nodes"] for r in rows]
        ax[0].plot(ns, [r["rate"] for r in rows], "o-", label="measured")
        ax[0].plot(ns, [n * rows[0]["rate"] for n in ns], "--", label="N x one node")
        ax[0].set_xlabel("nodes")
        ax[0].set_ylabel("jobs/s")
        ax[0].legend()
        ax[1].plot(ns, [r["efficiency"] for r in rows], "o-", label="rolloutd (simulated LLM)")
        ax[1].plot([1, 8], [1, 1.667 / 0.386 / 8], "s:", label="ProRL Agent 4B (paper)")
        ax[1].plot([1, 8], [1, 1.717 / 0.350 / 8], "s:", label="ProRL Agent 8B (paper)")
        ax[1].set_ylim(0, 1.1)
        ax[1].set_xlabel("nodes")
        ax[1].set_ylabel("parallel efficiency")
        ax[1].legend(fontsize=7)
        fig.tight_layout()
        fig.savefig(plot, dpi=110)
        print(f"plot: {plot}")
    failed = sum(r["failed_or_missing"] for r in rows)
    if failed:  # a rate over failed jobs measures nothing: make bench-smoke see it
        print(f"bench_scale: {failed} jobs failed or missing; the figures above are not a measurement", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
