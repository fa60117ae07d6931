"""Shared helpers for the benchmarks: a private ``rolloutd up``, per-process CPU accounting,
statistics and plot output.

Everything a benchmark starts is stopped by pid; nothing here kills by name.
"""
from __future__ import annotations

import atexit
import json
import os
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

REPO = Path(__file__).resolve().parent.parent
# Quick (smoke) runs must not overwrite the documented plots: without ROLLOUTD_BENCH_IMG_DIR
# (bench-smoke sets one), a --quick run's plots go to a scratch folder removed at exit. A
# --quick run by hand had overwritten docs/img/pipeline_*.png (e38d17b).
_IMG = os.environ.get("ROLLOUTD_BENCH_IMG_DIR")
if not _IMG and "--quick" in sys.argv:
    _IMG = tempfile.mkdtemp(prefix="rb-img-", dir="/tmp")
    atexit.register(shutil.rmtree, _IMG, True)
IMG_DIR = Path(_IMG or REPO / "docs" / "img")
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

# every helper a benchmark starts gets it (preexec_fn): a run killed part-way leaves nothing running
from rolloutd.daemons.children import die_with_parent  # noqa: E402

DAEMONS = ("events", "router", "gateway", "init", "run", "eval")


# ---- statistics -------------------------------------------------------------------------
def shown(path: Path) -> str:
    """A written file's path for the output: relative to the checkout when inside it."""
    return str(path.relative_to(REPO)) if path.is_relative_to(REPO) else str(path)


def median(xs) -> float:
    xs = list(xs)
    return statistics.median(xs) if xs else float("nan")


def percentile(xs, q: float) -> float:
    """Linear-interpolated percentile, q in 0..100."""
    xs = sorted(xs)
    if not xs:
        return float("nan")
    k = (len(xs) - 1) * q / 100.0
    lo = int(k)
    hi = min(lo + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (k - lo)


def steady_rate(times: list[float], lo: float = 0.1, hi: float = 0.9) -> float:
    """Completions per second between the ``lo`` and ``hi`` quantiles of completion times
    (leaves out the pipeline's fill and drain)."""
    ts = sorted(times)
    n = len(ts)
    if n < 10:
        return float("nan")
    a, b = int(lo * (n - 1)), int(hi * (n - 1))
    dt = ts[b] - ts[a]
    return (b - a) / dt if dt > 0 else float("nan")


def fmt_rate(x: float) -> str:
    return f"{x:,.0f}" if x >= 100 else f"{x:.1f}"


# ---- CPU accounting ---------------------------------------------------------------------
_HZ = os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """user+system CPU seconds of every thread of ``pid`` (0 when it is gone)."""
    try:
        s = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return 0.0
    f = s[s.rindex(")") + 2:].split()
    return (int(f[11]) + int(f[12])) / _HZ


class CpuMeter:
    """CPU seconds used by a set of processes between ``start()`` and ``stop()``."""

    def __init__(self, pids: dict[str, int]):
        self.pids = pids
        self.t0 = self.c0 = None
        self.result: dict[str, float] = {}
        self.wall = 0.0

    def start(self):
        self.c0 = {n: cpu_seconds(p) for n, p in self.pids.items()}
        self.t0 = time.monotonic()
        return self

    def stop(self) -> dict[str, float]:
        self.wall = time.monotonic() - self.t0
        self.result = {n: cpu_seconds(p) - self.c0[n] for n, p in self.pids.items()}
        return self.result

    def utilisation(self) -> dict[str, float]:
        """Fraction of one core per process."""
        return {n: c / self.wall for n, c in self.result.items()} if self.wall else {}


# ---- a private rolloutd up ---------------------------------------------------------------
def short_tmpdir(prefix: str = "rb-") -> Path:
    """A fresh dir under /tmp (ipc paths must fit in sockaddr_un's 108 bytes), removed at exit
    if the bench did not remove it first."""
    d = Path(tempfile.mkdtemp(prefix=prefix, dir="/tmp"))
    atexit.register(shutil.rmtree, d, True)
    return d


def _children_of(pid: int) -> list[int]:
    from rolloutd.sandbox.procs import children_map

    return children_map().get(pid, [])


def source_env(root: Path | str) -> tuple[dict, str]:
    """The environment and working directory that make ``python -m rolloutd...`` import the tree at
    ``root``. PYTHONPATH=root alone does not: ``root/rolloutd/__init__.py`` is found first and its
    subpackages then come from wherever rolloutd is installed (an editable install: this checkout),
    so an A/B of a patched copy measured the installed code twice. A shim package whose ``__path__``
    is ``root`` runs ``root``'s own ``rolloutd/__init__.py``; the cwd is the shim (not ``root``)."""
    root = Path(root).resolve()
    shim = _SHIMS.get(root)
    if shim is None:
        shim = _SHIMS[root] = Path(tempfile.mkdtemp(prefix="rb-src-", dir="/tmp"))
        atexit.register(shutil.rmtree, shim, True)
        (shim / "rolloutd").mkdir()
        init = root / "rolloutd" / "__init__.py"
        (shim / "rolloutd" / "__init__.py").write_text(
            f"__path__ = [{str(root)!r}]\n__file__ = {str(init)!r}\n"
            f"exec(compile(open(__file__).read(), __file__, 'exec'))\n")
    return dict(os.environ, PYTHONPATH=str(shim), PYTHONUNBUFFERED="1"), str(shim)


_SHIMS: dict[Path, Path] = {}


def child_result(out: str, rc: int | None, err: str, what: str) -> dict:
    """The ``RESULT {json}`` line a measured child process printed, or an error naming ``what``
    failed (its exit code and the end of its stderr)."""
    line = next((x for x in out.splitlines() if x.startswith("RESULT ")), None)
    if rc or line is None:
        raise RuntimeError(f"{what} failed (rc {rc}): {err[-2000:]}")
    return json.loads(line[7:])


def add_baseline_arg(ap) -> None:
    """``--root TREE``: the baseline of a same-run A/B (each run a process importing its tree
    through ``source_env``)."""
    ap.add_argument("--root", type=Path, default=None,
                    help="the baseline tree (e.g. a git worktree of an older commit); default: this tree only")


def ab_trees(root: Path | None) -> list[tuple[str, Path]]:
    """[("this", this checkout)] plus ("baseline", ``root``) when given."""
    return [("this", REPO)] + ([("baseline", Path(root).resolve())] if root else [])


def in_turn(items: list, rep: int) -> list:
    """``items`` in the order of repeat ``rep``: reversed in even repeats (with ``ab_trees``: the
    baseline first, b t t b b t ...), so no side always runs on a warmer or colder machine."""
    return items if rep % 2 else items[::-1]


class Rolloutd:
    """``rolloutd up`` in a private runtime directory, from the source tree ``root``
    (default: this repository; pass a scratch copy to A/B a patch)."""

    def __init__(self, sets: dict | None = None, root: Path | str = REPO, log_level: str = "warning"):
        self.root = Path(root)
        self.sets = {"logging.level": log_level, **(sets or {})}
        self.tmp = short_tmpdir()
        self.runtime_dir = self.tmp / "run"
        self.gateway = f"ipc://{self.runtime_dir}/gateway.sock"
        self.log_path = self.tmp / "up.log"
        self.proc: subprocess.Popen | None = None
        self.pids: dict[str, int] = {}

    def start(self, timeout_s: float = 60.0) -> "Rolloutd":
        from rolloutd.daemons.supervisor import wait_ready

        cmd = [sys.executable, "-m", "rolloutd.daemons.cli", "up", "--runtime-dir", str(self.runtime_dir)]
        for k, v in self.sets.items():
            cmd += ["--set", f"{k}={v}"]
        env, cwd = source_env(self.root)
        self.proc = subprocess.Popen(cmd, cwd=cwd, env=env, stdin=subprocess.DEVNULL,
                                     stdout=open(self.log_path, "w"), stderr=subprocess.STDOUT,
                                     preexec_fn=die_with_parent)
        try:
            wait_ready(self.gateway, timeout_s)
        except Exception:
            self.stop()
            raise RuntimeError(f"rolloutd up did not become ready; log:\n{self.log()[-3000:]}") from None
        for pid in _children_of(self.proc.pid):
            try:
                argv = Path(f"/proc/{pid}/cmdline").read_bytes().split(b"\0")
            except OSError:
                continue
            if b"rolloutd.daemons.cli" in argv:
                name = argv[argv.index(b"rolloutd.daemons.cli") + 1].decode()
                self.pids[name] = pid
        return self

    def client(self, **kw):
        from rolloutd.gateway.client import RolloutClient

        return RolloutClient(self.gateway, **kw)

    def log(self) -> str:
        try:
            return self.log_path.read_text(errors="replace")
        except OSError:
            return ""

    def stop(self, timeout_s: float = 30.0):
        if self.proc is not None and self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)
            # The supervisor stops its children one after the other (about 0.5 s each); once it
            # is stopping (no restarts), signal them all at once: a benchmark needs no ordered drain.
            time.sleep(0.3)
            for pid in self.pids.values():
                try:
                    os.kill(pid, signal.SIGTERM)
                except OSError:
                    pass
            try:
                self.proc.wait(timeout_s)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait(5)
        for pid in self.pids.values():  # PDEATHSIG should have taken them; make sure
            try:
                os.kill(pid, 0)
            except OSError:
                continue
            try:
                os.kill(pid, signal.SIGKILL)
            except OSError:
                pass
        shutil.rmtree(self.tmp, ignore_errors=True)

    def __enter__(self):
        return self.start()

    def __exit__(self, *exc):
        self.stop()


# ---- py-spy ------------------------------------------------------------------------------
def stop_procs(procs, logs=(), wait_s: float = 15.0) -> None:
    """SIGTERM every process (a clean daemon stop), wait, kill what outlives ``wait_s``; close logs."""
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    for p in procs:
        try:
            p.wait(wait_s)
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait(5)
    for f in logs:
        f.close()


def pyspy_path() -> str | None:
    cand = Path(sys.executable).parent / "py-spy"
    if cand.exists():
        return str(cand)
    return shutil.which("py-spy")


def pyspy_start(pids: dict[str, int], seconds: float, out_dir: Path, rate: int = 200) -> list:
    """Start ``py-spy record`` (raw collapsed stacks) on each pid; returns the Popen list.

    ``--gil``: only samples holding the GIL, i.e. Python on a CPU. Without it a thread that a
    syscall's wake-up of another process got descheduled counts as busy there: on 2 shared
    cores ``Socket.send`` showed 18-26% of the gateway's samples, 3% with ``--gil``."""
    exe = pyspy_path()
    if exe is None:
        print("  (py-spy not found; skipping profile)")
        return []
    out_dir.mkdir(parents=True, exist_ok=True)
    procs = []
    for name, pid in pids.items():
        out = out_dir / f"{name}.txt"
        procs.append((name, out, subprocess.Popen(
            [exe, "record", "--pid", str(pid), "-d", str(int(seconds)), "-r", str(rate), "-f", "raw",
             "-o", str(out), "--nonblocking", "--gil"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
            preexec_fn=die_with_parent)))
    return procs


# Where a daemon's samples go, by the first of these found from a sample's innermost frame outwards.
PYSPY_CATEGORIES = (("sockets", ("bus/sockets.py", "zmq/")), ("msgpack", ("bus/codec.py", "msgpack/")),
                    ("message checks", ("bus/messages.py",)), ("credit", ("bus/credit.py",)),
                    ("events", ("bus/events.py", "lease_rows")), ("handler", ("handlers/",)),
                    ("logging", ("structlog", "logging/")), ("asyncio", ("asyncio/",)),
                    ("own code", ("daemons/", "gateway/", "bus/", "endpoint/", "llm/")))


def _category(frames: list[str]) -> str:
    for f in reversed(frames):
        for name, keys in PYSPY_CATEGORIES:
            if any(k in f for k in keys):
                return name
    return "other"


def pyspy_report(procs, top: int = 12) -> dict[str, list[tuple[float, str]]]:
    """Wait for the recorders and summarise each profile: inclusive share of the project's own
    functions and self share of every function."""
    import collections

    out = {}
    for name, path, p in procs:
        p.wait()
        try:
            lines = path.read_text().splitlines()
        except OSError:
            continue
        selfc, incl, cats, total = collections.Counter(), collections.Counter(), collections.Counter(), 0
        for line in lines:
            stack, _, cnt = line.rpartition(" ")
            if not stack:
                continue
            n = int(cnt)
            total += n
            frames = stack.split(";")
            selfc[frames[-1]] += n
            cats[_category(frames)] += n
            for f in set(frames):
                incl[f] += n
        if not total:
            continue
        own = [(c / total, f) for f, c in incl.most_common()
               if any(f"({pkg}/" in f for pkg in ("bus", "daemons", "gateway", "handlers"))
               and "cli.py" not in f and "base.py:85" not in f and "base.py:55" not in f][:top]
        slf = [(c / total, f) for f, c in selfc.most_common(top)]
        out[name] = {"samples": total, "inclusive_own": own, "self": slf,
                     "categories": [(c / total, k) for k, c in cats.most_common()]}
    return out


# ---- plots -------------------------------------------------------------------------------
def plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as pyplot

    return pyplot


def loadavg() -> str:
    try:
        return " ".join(Path("/proc/loadavg").read_text().split()[:3])
    except OSError:
        return "?"


def revision(root) -> str:
    """``git describe``-like id of the tree the daemons run from (``+dirty`` with local edits)."""
    try:
        head = subprocess.run(["git", "-C", str(root), "rev-parse", "--short", "HEAD"], capture_output=True,
                              text=True, timeout=5).stdout.strip()
        dirty = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no"],
                               capture_output=True, text=True, timeout=5).stdout.strip()
        return (head or "?") + ("+dirty" if dirty else "")
    except (OSError, subprocess.SubprocessError):
        return "?"


def machine() -> str:
    import platform

    try:
        model = next(line.split(":", 1)[1].strip() for line in open("/proc/cpuinfo") if line.startswith("model name"))
    except (OSError, StopIteration):
        model = platform.processor()
    return f"{os.cpu_count()} cores, {model}, Python {platform.python_version()}"
