"""Sandbox benchmarks: bash action latency vs tmux and SWE-ReX, bwrap start-up, 128 sandboxes.

    .venv/bin/python bench/bench_sandbox.py [--quick] [--json out.json] [--ref-toolserver DIR]
                                            [--hardening-only | --pty-only | --disk-only [--disk-mb MB] [--rounds N]
                                             | --uids-only [--ref-bwrap FILE] [--rounds N]]

1. Action latency of one bash call, client to result, for `true` (pure overhead) and
   `ls -la /usr/bin | head`:
     ours/bwrap   ToolClient -> Unix socket -> tool server in a bwrap sandbox -> pty bash
     ours/local   the same tool server without a sandbox (same footing as the baselines)
     ours/ref     with --ref-toolserver DIR: another tool server's sources (e.g. a `git archive`
                  of an older commit's sandbox/toolserver) in a bwrap sandbox: before/after
     tmux         libtmux send-keys + capture-pane polled in a tight loop (no sleep: tmux's
                  best case; real harnesses sleep between polls and are slower)
     swe-rex      SWE-ReX LocalRuntime bash session (pexpect), in-process, no HTTP server
2. bwrap sandbox start (create() until the tool server answers a ping), sequential.
3. 128 sandboxes at once: start all, one action in each (AsyncToolClient, concurrently),
   destroy all; then verify nothing leaked (processes, dirs, loopback addresses).
4. Issue 24 (--hardening-only runs just this), before/after in one run, interleaved:
   `true` round trip and sandbox ready with the tool server hardened (non-dumpable, seccomp
   filter on its children) vs not (SandboxSpec.env ROLLOUTD_UNSAFE_DUMPABLE=1: the baseline
   knob), and the eval start-up of
   grading: the old path (bash `restart: true` + the command in the fresh shell) vs the grade
   tool (purge + fresh process), each after the agent left N background processes.
5. Issue 24 red team (--pty-only runs just this), interleaved: sandbox ready and destroy with
   a devpts instance of its own (max_ptys, 16, as root) and --disable-userns vs neither.
6. Sandbox ready with a workspace quota (--disk-only runs just this; --disk-mb, default 4096, the
   swe domain's), interleaved round by round: `measured` (no mounts: the baseline), `tmpfs`,
   `loop_direct` (the loop image made on the start's path: copy, LOOP_CONFIGURE, fsmount; what
   every start paid before the pool) and `loop_pool` (the default as root: made ahead by
   bounds.WorkspacePool, the start only move_mounts it); with the start's steps timed.
   --ref-bounds FILE adds `loop_ref`: another revision's sandbox/bounds.py (one with
   make_ext4_image + mount_ext4_image, e.g. `git show a6f7d4d:sandbox/bounds.py > FILE`, the
   code before the pool) doing the loop workspace on the start's path: a true before/after.
7. Issue 35 (--uids-only runs just this), interleaved round by round: sandbox ready (create ->
   ping), the first bash `true` and destroy, then the `true` round trip (one sandbox per kind held,
   calls interleaved call by call), with a host uid per sandbox,
   host-made tmpfs (/tmp, /dev/shm with an inode bound) and the grader's scratch mount (`now`, the
   default) vs the same code with `uid_range=""` (`shared_uid`: isolates the allocator's cost);
   --ref-bwrap FILE adds `before`: another revision's sandbox/bwrap.py (e.g. `git show
   fe23baf:sandbox/bwrap.py > FILE`: every sandbox as nobody, bwrap's own tmpfs, no scratch) on
   this revision's runtime.py.
Medians are the headline (the machine is shared and noisy); p99 is reported too.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import shutil
import statistics
import sys
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Callable, Dict, List, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))  # warnings only

from rolloutd.sandbox import AsyncToolClient, SandboxSpec, ToolClient, get_runtime, procs, toollib  # noqa: E402

COMMANDS = {"true": "true", "ls": "ls -la /usr/bin | head"}


def pct(xs: List[float], q: float) -> float:
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q * (len(xs) - 1))))]


def summarize(xs: List[float]) -> Dict[str, float]:
    return {"median_ms": statistics.median(xs) * 1000, "p99_ms": pct(xs, 0.99) * 1000, "n": len(xs)}


def timed(fn: Callable[[], object], n: int, warmup: int = 5) -> List[float]:
    for _ in range(warmup):
        fn()
    out = []
    for _ in range(n):
        t0 = time.perf_counter()
        fn()
        out.append(time.perf_counter() - t0)
    return out


TRUE = {"command": "true", "timeout": 30}


def start_true_destroy(rt, name: str, spec: Optional[SandboxSpec] = None):
    """One sandbox's life, timed in seconds: ``ready`` (create() returned), ``first_true`` (from
    the start to the first bash `true` done: the shell starts in the background) and ``destroy``.
    Returns (times, the destroyed handle)."""
    t0 = time.perf_counter()
    h = rt.create(name, spec or SandboxSpec())
    t1 = time.perf_counter()
    with ToolClient(h.tool_socket) as c:
        assert c.call("bash", TRUE).exit_code == 0
    t2 = time.perf_counter()
    rt.destroy(h)
    return {"ready": t1 - t0, "first_true": t2 - t0, "destroy": time.perf_counter() - t2}, h


def true_round_trips(cs: Dict[str, ToolClient], n: int, warmup: int) -> Dict[str, List[float]]:
    """The bash `true` round trip in seconds, ``n`` per held sandbox, interleaved call by call
    after ``warmup`` untimed rounds."""
    for _ in range(warmup):
        for c in cs.values():
            c.call("bash", TRUE)
    lat: Dict[str, List[float]] = {k: [] for k in cs}
    for _ in range(n):
        for k, c in cs.items():
            t0 = time.perf_counter()
            r = c.call("bash", TRUE)
            lat[k].append(time.perf_counter() - t0)
            assert r.exit_code == 0, r
    return lat


# -- latency: the harnesses ----------------------------------------------------------
class Ours:
    def __init__(self, kind: str, root: Path, src: Optional[Path] = None) -> None:
        self.name = "ours_" + kind if src is None else "ours_ref"
        self.rt = get_runtime(kind, root_dir=root / self.name)
        own = toollib._SRC
        toollib._SRC = src or own  # the sandbox's tool server is copied from here at create()
        try:
            self.h = self.rt.create("bench-latency")
        finally:
            toollib._SRC = own
        self.c = ToolClient(self.h.tool_socket)
        self.server_side: List[float] = []

    def call(self, cmd: str) -> None:
        r = self.c.call("bash", {"command": cmd, "timeout": 30})
        assert r.exit_code == 0, r
        if cmd == "true":
            self.server_side.append(r.duration)

    def close(self) -> None:
        self.c.close()
        self.rt.destroy(self.h)


class Tmux:
    """libtmux send-keys + capture-pane, polled with no sleep (tmux's best case)."""

    name = "tmux"

    def __init__(self) -> None:
        import libtmux

        if shutil.which("tmux") is None:
            raise RuntimeError("tmux binary not installed")
        self.server = libtmux.Server(socket_name="rld-bench-%d" % os.getpid())
        sess = self.server.new_session(session_name="bench", window_command="bash --noprofile --norc", x=200, y=50)
        self.pane = sess.active_window.active_pane
        self.n = 0

    def call(self, cmd: str) -> None:
        self.n += 1
        marker = "__DONE_%d__" % self.n
        self.pane.send_keys("%s; echo %s" % (cmd, marker), enter=True)
        deadline = time.monotonic() + 30
        while not any(line.strip() == marker for line in self.pane.capture_pane()):
            if time.monotonic() > deadline:
                raise TimeoutError(cmd)
        self.pane.cmd("clear-history")

    def close(self) -> None:
        self.server.kill()


class SweRex:
    """SWE-ReX LocalRuntime bash session (pexpect), called in-process."""

    name = "swerex"

    def __init__(self) -> None:
        from swerex.runtime.abstract import BashAction, CreateBashSessionRequest
        from swerex.runtime.local import LocalRuntime

        self.BashAction = BashAction
        self.loop = asyncio.new_event_loop()
        self.rt = LocalRuntime()
        # its 1 s default start-up timeout fails on a loaded machine
        self.loop.run_until_complete(self.rt.create_session(CreateBashSessionRequest(startup_timeout=30)))
        self.lost = 0

    def call(self, cmd: str) -> None:
        r = self.loop.run_until_complete(self.rt.run_in_session(self.BashAction(command=cmd, timeout=30, check="silent")))
        self.lost += r.exit_code != 0  # its exit-code probe can fail under load

    def close(self) -> None:
        self.loop.run_until_complete(self.rt.close())
        self.loop.close()


def command_cost(run_script: Callable[[str], str], cmd: str, reps: int = 30) -> float:
    """What the command itself costs (ms), timed by bash around a loop inside one shell."""
    script = "TIMEFORMAT=%%R; time (for i in $(seq %d); do %s >/dev/null; done) 2>&1" % (reps, cmd)
    return float(run_script(script).strip().splitlines()[-1]) * 1000 / reps


def bench_latency(root: Path, n: int, out: Dict[str, object], ref: Optional[Path] = None
                  ) -> Dict[str, Dict[str, Dict[str, float]]]:
    """All harnesses interleaved call by call, so load drift on a shared machine hits
    them equally; the command's own cost is sampled throughout, inside the sandbox and on
    the host, and its median subtracted to estimate each harness's overhead."""
    import subprocess

    harnesses: List[object] = [Ours("bwrap", root), Ours("local", root)]
    if ref is not None:
        harnesses.append(Ours("bwrap", root, src=ref))
    for factory in (Tmux, SweRex):
        try:
            harnesses.append(factory())
        except Exception as e:  # report why, keep the other numbers
            out[factory.name + "_error"] = "%s: %s" % (type(e).__name__, e)
    ours = harnesses[0]
    host = lambda script: subprocess.run(["bash", "-c", script], capture_output=True, text=True).stdout  # noqa: E731
    sandboxed = lambda script: ours.c.call("bash", {"command": script, "timeout": 60}).output  # noqa: E731
    res: Dict[str, Dict[str, Dict[str, float]]] = {h.name: {} for h in harnesses}
    costs: Dict[str, Dict[str, List[float]]] = {"sandbox": {}, "host": {}}
    try:
        for name, cmd in COMMANDS.items():
            times: Dict[str, List[float]] = {h.name: [] for h in harnesses}
            for h in harnesses:
                for _ in range(3):
                    h.call(cmd)
            costs["sandbox"][name], costs["host"][name] = [], []
            for i in range(n):
                if i % max(1, n // 5) == 0:
                    costs["sandbox"][name].append(command_cost(sandboxed, cmd))
                    costs["host"][name].append(command_cost(host, cmd))
                for h in harnesses:
                    t0 = time.perf_counter()
                    h.call(cmd)
                    times[h.name].append(time.perf_counter() - t0)
            for h in harnesses:
                res[h.name][name] = summarize(times[h.name])
                where = "sandbox" if h.name in ("ours_bwrap", "ours_ref") else "host"
                res[h.name][name]["command_cost_ms"] = statistics.median(costs[where][name])
        res["ours_bwrap"]["true_server_side"] = summarize(ours.server_side)
        for h in harnesses:
            if isinstance(h, SweRex):
                res[h.name]["exit_code_lost"] = h.lost  # type: ignore[assignment]
    finally:
        for h in harnesses:
            h.close()
    return res


# -- start-up and fleet ---------------------------------------------------------------
def bench_startup(root: Path, n: int) -> Dict[str, Dict[str, float]]:
    """create() returns once the tool server answers a ping; the shell itself starts in
    the background, so the first bash call is timed too (start -> first `true` done)."""
    rt = get_runtime("bwrap", root_dir=root / "startup")
    ready, first, destroy = [], [], []
    for i in range(n + 2):
        t, _ = start_true_destroy(rt, "start-%d" % i)
        if i >= 2:  # the first two warm the page cache
            ready.append(t["ready"])
            first.append(t["first_true"])
            destroy.append(t["destroy"])
    return {"ready": summarize(ready), "first_action": summarize(first), "destroy": summarize(destroy)}


def bench_fleet(root: Path, count: int, workers: int) -> Dict[str, object]:
    rt = get_runtime("bwrap", root_dir=root / "fleet")
    t0 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        handles = list(ex.map(lambda i: rt.create("fleet-%d" % i, SandboxSpec()), range(count)))
    t_start = time.perf_counter() - t0

    async def act():
        clients = [AsyncToolClient(h.tool_socket) for h in handles]
        try:
            rs = await asyncio.gather(*[c.call("bash", {"command": "echo $ROLLOUTD_JOB_ID", "timeout": 60})
                                        for c in clients])
        finally:
            await asyncio.gather(*[c.close() for c in clients])
        return rs

    t1 = time.perf_counter()
    results = asyncio.run(act())
    t_act = time.perf_counter() - t1
    ok = all(r.output.strip() == h.job_id for r, h in zip(results, handles))
    loopbacks = {h.loopback for h in handles}
    # A sandbox's processes are its namespace init (pids[1]) and the init's descendants.
    inits = [(h.pids[1], h.extra["pid_starts"][1]) for h in handles]
    all_pids = [p for h in handles for p in h.pids]
    t2 = time.perf_counter()
    with ThreadPoolExecutor(workers) as ex:
        list(ex.map(rt.destroy, handles))
    t_destroy = time.perf_counter() - t2
    total = time.perf_counter() - t0
    leaked_procs = [p for pid, start in inits for p in procs.namespace_pids(pid, start)]
    leaked_pids = [p for p in all_pids if procs.is_running(p)]
    leaked_dirs = list((root / "fleet" / "sb").iterdir())
    leaked_addrs = rt.loopback.allocated()
    return {
        "count": count, "workers": workers, "start_s": t_start, "action_s": t_act, "destroy_s": t_destroy,
        "total_s": total, "actions_ok": ok, "unique_loopbacks": len(loopbacks),
        "leaked_processes": len(leaked_procs) + len(leaked_pids), "leaked_dirs": len(leaked_dirs),
        "leaked_loopbacks": len(leaked_addrs),
    }


def bench_hardening(root: Path, n: int, n_start: int, leftovers: int = 5) -> Dict[str, object]:
    rt = get_runtime("bwrap", root_dir=root / "hardening")
    unsafe = SandboxSpec(env={"ROLLOUTD_UNSAFE_DUMPABLE": "1"})
    res: Dict[str, object] = {}
    # sandbox ready, alternating the two variants
    ready: Dict[str, List[float]] = {"hardened": [], "dumpable": []}
    for i in range(2 * (n_start + 1)):
        kind = "hardened" if i % 2 == 0 else "dumpable"
        t0 = time.perf_counter()
        h = rt.create("ready-%d" % i, SandboxSpec() if kind == "hardened" else unsafe)
        if i >= 2:
            ready[kind].append(time.perf_counter() - t0)
        rt.destroy(h)
    res["ready"] = {k: summarize(v) for k, v in ready.items()}
    hs = {"hardened": rt.create("lat-h", SandboxSpec()), "dumpable": rt.create("lat-d", unsafe)}
    cs = {k: ToolClient(h.tool_socket) for k, h in hs.items()}
    try:
        info = {k: c.ping().info.get("hardened") for k, c in cs.items()}
        assert info == {"hardened": True, "dumpable": False}, info
        res["true"] = {k: summarize(v) for k, v in true_round_trips(cs, n, warmup=5).items()}
        # eval start-up: old path vs grade, in the hardened sandbox, after `leftovers` processes
        c = cs["hardened"]
        plant = " ".join("sleep 1000 &" for _ in range(leftovers)) + " true"
        ev: Dict[str, List[float]] = {"old_restart_bash": [], "grade": []}
        purge_ms: List[float] = []
        for i in range(max(6, n // 5)):
            for k in ("old_restart_bash", "grade"):
                c.call("bash", {"command": plant, "timeout": 30})
                t0 = time.perf_counter()
                if k == "grade":
                    r = c.call("grade", {"argv": ["true"], "timeout": 30})
                    purge_ms.append(r.info["purged"]["purge_ms"])
                else:
                    r = c.call("bash", {"command": "true", "restart": True, "timeout": 30})
                dt = time.perf_counter() - t0
                assert r.exit_code == 0 and r.error is None, r
                if i >= 1:
                    ev[k].append(dt)
        res["eval_startup"] = {k: summarize(v) for k, v in ev.items()}
        res["eval_startup"]["grade_purge_ms_median"] = statistics.median(purge_ms)
        res["eval_startup"]["leftovers"] = leftovers
    finally:
        for c in cs.values():
            c.close()
        for h in hs.values():
            rt.destroy(h)
    return res


def bench_pty_userns(root: Path, n: int) -> Dict[str, object]:
    """Section 5 (issue 24 red team): sandbox ready and destroy with the per-sandbox devpts
    instance (max_ptys, 16, root only) and --disable-userns vs neither, interleaved, same run."""
    rts = {"bounded": get_runtime("bwrap", root_dir=root / "pty-b"),
           "unbounded": get_runtime("bwrap", root_dir=root / "pty-u", max_ptys=None)}
    rts["unbounded"].disable_userns = False
    ready: Dict[str, List[float]] = {k: [] for k in rts}
    destroy: Dict[str, List[float]] = {k: [] for k in rts}
    for i in range(n + 2):
        for k, rt in rts.items():
            t0 = time.perf_counter()
            h = rt.create("pty-%d" % i, SandboxSpec())
            t1 = time.perf_counter()
            rt.destroy(h)
            if i >= 2:
                ready[k].append(t1 - t0)
                destroy[k].append(time.perf_counter() - t1)
    return {"ready": {k: summarize(v) for k, v in ready.items()},
            "destroy": {k: summarize(v) for k, v in destroy.items()},
            "devpts": os.geteuid() == 0 and rts["bounded"].disk_quota != "measured"}


def _ref_bounds_runtime(path: Path, root: Path):
    """A bwrap runtime whose loop workspace is made by another revision's bounds.py, on the
    start's path, as that revision's Runtime._bound_dirs did (image from a template, mount)."""
    import importlib.util

    from rolloutd.sandbox.bwrap import BwrapRuntime

    spec = importlib.util.spec_from_file_location("rolloutd_ref_bounds", str(path))
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)  # type: ignore[union-attr]

    class RefBounds(BwrapRuntime):
        def _bound_dirs(self, d: Path, disk_mb: Optional[float], owner) -> Dict[str, str]:
            uid, gid = owner
            size = int(float(disk_mb) * 2**20) // 4096 * 4096
            ref.make_ext4_image(d / "disk.img", size, uid, gid, templates=self.root_dir / "disk-templates")
            ref.mount_ext4_image(d / "disk.img", d / "workspace")
            return {"workspace": "loop", "run": "read-only"}

    return RefBounds(root, ready_timeout=60, disk_quota="loop", disk_pool=0)


def bench_disk_ready(root: Path, n: int, disk_mb: int, ref_bounds: Optional[Path] = None) -> Dict[str, object]:
    """Section 6: create() -> ping per workspace-quota mechanism, interleaved (order rotated
    each round), then the first bash `true` and destroy; the start's own steps are timed in
    this thread only (the pool's filler thread runs beside it and is not counted)."""
    from rolloutd.sandbox import Limits, bounds
    from rolloutd.sandbox.bwrap import BwrapRuntime
    from rolloutd.sandbox.runtime import Runtime

    why = bounds.why_no_mounts()
    kinds = {"measured": {"disk_quota": "measured"}}
    if why is None:
        kinds.update({"tmpfs": {"disk_quota": "tmpfs"}, "loop_direct": {"disk_quota": "loop", "disk_pool": 0},
                      "loop_pool": {"disk_quota": "loop"}})
    rts = {k: get_runtime("bwrap", root_dir=root / ("disk-" + k), ready_timeout=60, **kw) for k, kw in kinds.items()}
    if ref_bounds is not None and why is None:
        rts["loop_ref"] = _ref_bounds_runtime(ref_bounds, root / "disk-loop_ref")
    me = __import__("threading").get_ident()
    steps: Dict[str, float] = {}
    patched = []

    def timed_step(cls, name, label):
        f = cls.__dict__[name]

        def g(*a, **k):
            t0 = time.perf_counter()
            try:
                return f(*a, **k)
            finally:
                if __import__("threading").get_ident() == me:
                    steps[label] = steps.get(label, 0.0) + (time.perf_counter() - t0) * 1000
        setattr(cls, name, g)
        patched.append((cls, name, f))

    timed_step(Runtime, "_bound_dirs", "workspace_fs")
    if "loop_ref" in rts:
        timed_step(type(rts["loop_ref"]), "_bound_dirs", "workspace_fs")
    timed_step(BwrapRuntime, "_pre_launch", "socket_devpts")
    timed_step(BwrapRuntime, "_launch", "bwrap_to_namespace")
    timed_step(Runtime, "_wait_ready", "tool_server_ready")
    spec = SandboxSpec(limits=Limits(disk_mb=disk_mb))
    samples: Dict[str, Dict[str, List[float]]] = {k: {} for k in rts}
    try:
        for k, rt in rts.items():  # warm-up: tool library, templates, page cache; fills the pool
            rt.destroy(rt.create("warm", spec))
        order = list(rts)
        for i in range(n):
            for k in order[i % len(order):] + order[:i % len(order)]:
                rt = rts[k]
                steps.clear()
                t, _ = start_true_destroy(rt, "disk-%d" % i, spec)
                row = dict(steps, **{w: v * 1000 for w, v in t.items()})
                for name, v in row.items():
                    samples[k].setdefault(name, []).append(v)
    finally:
        for cls, name, f in patched:
            setattr(cls, name, f)
    out: Dict[str, object] = {"disk_mb": disk_mb, "not_root": why, "n": n, "kinds": {}}
    for k, rt in rts.items():
        med = {name: statistics.median(v) for name, v in samples[k].items()}
        med["ready_p90"] = pct(samples[k]["ready"], 0.9)
        pool = getattr(rt, "_disk_pool", None)
        if pool is not None:
            med["pool_hits"], med["pool_misses"] = pool.hits, pool.misses
            pool.close()
        out["kinds"][k] = med
    return out


def _ref_bwrap_runtime(path: Path, root: Path):
    """A runtime from another revision's sandbox/bwrap.py, imported as a module of this package
    (its relative imports resolve here: runtime.py, bounds.py, uids.py are this revision's)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("rolloutd.sandbox._ref_bwrap", str(path))
    ref = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(ref)  # type: ignore[union-attr]
    return ref.BwrapRuntime(root, ready_timeout=60)


def bench_uids(root: Path, n: int, calls: int, ref_bwrap: Optional[Path] = None) -> Dict[str, object]:
    """Section 7: what a uid per sandbox (+ host tmpfs, grader's scratch) costs a start and a call."""
    rts = {"now": get_runtime("bwrap", root_dir=root / "uid-now", ready_timeout=60),
           "shared_uid": get_runtime("bwrap", root_dir=root / "uid-shared", ready_timeout=60, uid_range="")}
    if ref_bwrap is not None:
        rts["before"] = _ref_bwrap_runtime(ref_bwrap, root / "uid-before")
    samples: Dict[str, Dict[str, List[float]]] = {k: {"ready": [], "first_true": [], "true": [], "destroy": []}
                                                  for k in rts}
    uids: Dict[str, set] = {k: set() for k in rts}
    for k, rt in rts.items():  # warm-up: tool library, page cache
        rt.destroy(rt.create("warm", SandboxSpec()))
    order = list(rts)
    for i in range(n):  # start-up: a fresh sandbox per kind per round, the order rotated
        for k in order[i % len(order):] + order[:i % len(order)]:
            t, h = start_true_destroy(rts[k], "uid-%d" % i)
            uids[k].add(h.extra.get("uid"))
            for w, v in t.items():
                samples[k][w].append(v)
    # the `true` round trip: one sandbox per kind held, calls interleaved call by call
    hs = {k: rt.create("uid-true", SandboxSpec()) for k, rt in rts.items()}
    try:
        cs = {k: ToolClient(h.tool_socket) for k, h in hs.items()}
        for k, v in true_round_trips(cs, n * calls, warmup=10).items():
            samples[k]["true"] = v
        for c in cs.values():
            c.close()
    finally:
        for k, h in hs.items():
            rts[k].destroy(h)
    return {"n": n, "calls": n * calls, "kinds": {k: {w: summarize(v) for w, v in sm.items()} for k, sm in samples.items()},
            "distinct_uids": {k: len(v) for k, v in uids.items()}, "root": os.geteuid() == 0}


def report_uids(u: Dict[str, object]) -> None:
    ks = u["kinds"]
    print("issue 35, same run, interleaved, %d rounds of start-ups, %d `true` calls per kind (now = a uid per sandbox + host tmpfs + "
          "grader's scratch; shared_uid = uid_range=\"\"; before = --ref-bwrap)%s:"
          % (u["n"], u["calls"], "" if u["root"] else " [not root: no uid switch, no host tmpfs]"))
    for k, m in ks.items():
        vs = "".join("  ready %.2fx / true %.2fx %s" % (m["ready"]["median_ms"] / ks[o]["ready"]["median_ms"],
                                                        m["true"]["median_ms"] / ks[o]["true"]["median_ms"], o)
                     for o in ("before", "shared_uid") if o in ks and o != k and k == "now")
        print("  %-10s ready %6.1f (p99 %6.1f)  first true %6.1f  true %5.2f (p99 %5.2f)  destroy %5.1f  uids %d%s" % (
            k, m["ready"]["median_ms"], m["ready"]["p99_ms"], m["first_true"]["median_ms"], m["true"]["median_ms"],
            m["true"]["p99_ms"], m["destroy"]["median_ms"], u["distinct_uids"][k], vs))


def report_disk_ready(d: Dict[str, object]) -> None:
    ks = d["kinds"]
    base = ks["measured"]["ready"]
    print("sandbox ready with a %d MB workspace quota, same run, interleaved, n=%d per kind, median ms%s:"
          % (d["disk_mb"], d["n"], "" if not d["not_root"] else " [%s: measured only]" % d["not_root"]))
    for k, m in ks.items():
        vs = "" if k == "measured" else "  %.2fx measured" % (m["ready"] / base)
        for other in ("loop_direct", "loop_ref"):
            if k == "loop_pool" and other in ks:
                vs += ", %.2fx %s" % (m["ready"] / ks[other]["ready"], other)
        pool = " pool hits %d/%d" % (m["pool_hits"], m["pool_hits"] + m["pool_misses"]) if "pool_hits" in m else ""
        print("  %-11s ready %6.1f (p90 %6.1f)  first true %6.1f  destroy %5.1f%s%s" % (
            k, m["ready"], m["ready_p90"], m["first_true"], m["destroy"], vs, pool))
        print("  %-11s steps: workspace fs %.2f, socket+devpts %.2f, bwrap to namespace %.2f, tool server ready %.2f"
              % ("", m.get("workspace_fs", 0), m.get("socket_devpts", 0), m.get("bwrap_to_namespace", 0),
                 m.get("tool_server_ready", 0)))


def report_pty_userns(p: Dict[str, object]) -> None:
    print("issue 24 red team, same run, interleaved (bounded = devpts max=16%s + --disable-userns; unbounded = neither):"
          % ("" if p["devpts"] else " [not root: no devpts instance]"))
    for what in ("ready", "destroy"):
        r = p[what]
        print("  %-7s median ms: bounded %.2f (p99 %.2f, n=%d) / unbounded %.2f (p99 %.2f): %.2fx" % (
            what, r["bounded"]["median_ms"], r["bounded"]["p99_ms"], r["bounded"]["n"],
            r["unbounded"]["median_ms"], r["unbounded"]["p99_ms"], r["bounded"]["median_ms"] / r["unbounded"]["median_ms"]))


def report_hardening(h: Dict[str, object]) -> None:
    print("issue 24, same run, interleaved (hardened = non-dumpable tool server + seccomp filter on its children; "
          "dumpable = neither):")
    for what in ("true", "ready"):
        r = h[what]
        print("  %-6s median ms: hardened %.2f (p99 %.2f, n=%d) / dumpable %.2f (p99 %.2f): %.2fx" % (
            what, r["hardened"]["median_ms"], r["hardened"]["p99_ms"], r["hardened"]["n"],
            r["dumpable"]["median_ms"], r["dumpable"]["p99_ms"], r["hardened"]["median_ms"] / r["dumpable"]["median_ms"]))
    e = h["eval_startup"]
    print("  eval start-up after %d leftover processes, median ms: old path (bash restart + true) %.2f (p99 %.2f) / "
          "grade true %.2f (p99 %.2f, purge %.2f ms of it), n=%d" % (
              e["leftovers"], e["old_restart_bash"]["median_ms"], e["old_restart_bash"]["p99_ms"],
              e["grade"]["median_ms"], e["grade"]["p99_ms"], e["grade_purge_ms_median"], e["grade"]["n"]))


def main(argv: Optional[List[str]] = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="fewer iterations (smoke run)")
    ap.add_argument("--fleet", type=int, default=None, help="sandboxes started at once (default 128, --quick 8)")
    ap.add_argument("--workers", type=int, default=16, help="threads creating/destroying the fleet")
    ap.add_argument("--json", type=Path, help="also write the raw results here")
    ap.add_argument("--ref-toolserver", type=Path, metavar="DIR",
                    help="also time this tool server source dir (before/after), e.g. from "
                         "`git archive OLD sandbox/toolserver | tar -x -C /tmp/old`: DIR=/tmp/old/sandbox/toolserver")
    ap.add_argument("--hardening-only", action="store_true", help="only section 4 (issue 24 before/after)")
    ap.add_argument("--pty-only", action="store_true", help="only section 5 (devpts max= and --disable-userns)")
    ap.add_argument("--disk-only", action="store_true", help="only section 6 (ready per workspace-quota mechanism)")
    ap.add_argument("--disk-mb", type=int, default=4096, help="section 6's workspace quota (default 4096)")
    ap.add_argument("--rounds", type=int, default=None, help="section 6's rounds (default 40, --quick 5)")
    ap.add_argument("--uids-only", action="store_true", help="only section 7 (a uid per sandbox, issue 35)")
    ap.add_argument("--ref-bwrap", type=Path, metavar="FILE",
                    help="section 7 also times this bwrap.py (before/after), e.g. from "
                         "`git show fe23baf:sandbox/bwrap.py > FILE` (every sandbox as nobody, before issue 35)")
    ap.add_argument("--ref-bounds", type=Path, metavar="FILE",
                    help="section 6 also times this bounds.py (before/after), e.g. from "
                         "`git show a6f7d4d:sandbox/bounds.py > FILE` (the code before the workspace pool)")
    ns = ap.parse_args(argv)
    n_lat, n_start = (20, 5) if ns.quick else (150, 40)
    fleet = ns.fleet if ns.fleet is not None else (8 if ns.quick else 128)
    root = Path(tempfile.mkdtemp(prefix="rldb", dir="/tmp"))
    os.chmod(root, 0o755)
    t_all = time.perf_counter()
    out: Dict[str, object] = {"machine": {"cpus": os.cpu_count(), "python": sys.version.split()[0],
                                          "loadavg_at_start": os.getloadavg()}}
    only = ns.pty_only or ns.hardening_only or ns.disk_only or ns.uids_only
    try:
        if ns.pty_only:
            out["pty_userns"] = bench_pty_userns(root, n_start)
        elif not only:
            out.update(bench_latency(root, n_lat, out, ns.ref_toolserver))
            out["startup_bwrap"] = bench_startup(root, n_start)
            out["fleet"] = bench_fleet(root, fleet, ns.workers)
        if ns.hardening_only or not only:
            out["hardening"] = bench_hardening(root, n_lat * 2, n_start)
            out["pty_userns"] = bench_pty_userns(root, n_start)
        if ns.disk_only or not only:
            out["disk_ready"] = bench_disk_ready(root, ns.rounds or (5 if ns.quick else 40), ns.disk_mb, ns.ref_bounds)
        if ns.uids_only or not only:
            out["uids"] = bench_uids(root, ns.rounds or (5 if ns.quick else 40), 5 if ns.quick else 20, ns.ref_bwrap)
    finally:
        from rolloutd.sandbox.runtime import _remove_sandbox_dir

        _remove_sandbox_dir(root)  # unmounts what a failed section left mounted, then deletes
    out["wall_s"] = time.perf_counter() - t_all
    if not only:
        report(out)
    if "hardening" in out:
        report_hardening(out["hardening"])
    if "pty_userns" in out:
        report_pty_userns(out["pty_userns"])
    if "disk_ready" in out:
        report_disk_ready(out["disk_ready"])
    if "uids" in out:
        report_uids(out["uids"])
    if ns.json:
        ns.json.write_text(json.dumps(out, indent=1))
    return 0


def report(out: Dict[str, object]) -> None:
    from rich.console import Console
    from rich.table import Table

    con = Console(width=140)
    t = Table(title="bash action latency (client call -> result), ms; overhead = median - the command's own cost")
    for col in ("implementation", "command", "median", "p99", "n", "overhead", "median vs ours/bwrap",
                "overhead vs ours/bwrap"):
        t.add_column(col)
    ours = out["ours_bwrap"]

    def overhead(impl: str, name: str) -> float:
        s = out[impl][name]
        return max(0.01, s["median_ms"] - s["command_cost_ms"])

    for impl in ("ours_bwrap", "ours_ref", "ours_local", "tmux", "swerex"):
        res = out.get(impl)
        if not res and impl == "ours_ref":
            continue
        if not res:
            t.add_row(impl, "-", "n/a", "n/a", "0", "-", out.get(impl + "_error", "not run"), "-")
            continue
        for name in COMMANDS:
            s = res[name]
            ov = overhead(impl, name)
            same = impl == "ours_bwrap"
            t.add_row(impl, COMMANDS[name], "%.2f" % s["median_ms"], "%.2f" % s["p99_ms"], str(s["n"]), "%.2f" % ov,
                      "-" if same else "%.1fx" % (s["median_ms"] / ours[name]["median_ms"]),
                      "-" if same else "%.1fx" % (ov / overhead("ours_bwrap", name)))
    con.print(t)
    con.print("command's own cost (ms, median of bash-timed loops sampled during the run): %s" % {
        impl: {name: round(out[impl][name]["command_cost_ms"], 2) for name in COMMANDS}
        for impl in ("ours_bwrap", "tmux") if out.get(impl)})
    s = ours["true_server_side"]
    con.print("ours/bwrap `true`, time inside the tool server: median %.2f ms, p99 %.2f ms" % (s["median_ms"], s["p99_ms"]))
    if out.get("swerex"):
        con.print("swe-rex calls whose exit code came back wrong/missing: %s" % out["swerex"].get("exit_code_lost"))
    st = out["startup_bwrap"]
    con.print("bwrap sandbox start -> tool server ready (create() returns): median %.1f ms, p99 %.1f ms (n=%d)"
              % (st["ready"]["median_ms"], st["ready"]["p99_ms"], st["ready"]["n"]))
    con.print("bwrap sandbox start -> first bash `true` done: median %.1f ms, p99 %.1f ms; destroy median %.1f ms"
              % (st["first_action"]["median_ms"], st["first_action"]["p99_ms"], st["destroy"]["median_ms"]))
    f = out["fleet"]
    con.print("%d sandboxes at once (%d creator threads): start %.2f s, one action each %.2f s, destroy %.2f s, "
              "total %.2f s; actions ok=%s, unique loopbacks=%d; leaked processes=%d dirs=%d loopbacks=%d"
              % (f["count"], f["workers"], f["start_s"], f["action_s"], f["destroy_s"], f["total_s"], f["actions_ok"],
                 f["unique_loopbacks"], f["leaked_processes"], f["leaked_dirs"], f["leaked_loopbacks"]))
    con.print("benchmark wall time %.1f s" % out["wall_s"])


if __name__ == "__main__":
    sys.exit(main())
