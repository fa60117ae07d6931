"""Shared machinery of the ops tests: tracked processes, private network namespaces, a
single-node Slurm cluster. Everything started here is stopped by its owner's ``close()``;
every wait is bounded."""
from __future__ import annotations

import json
import os
import queue
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
from pathlib import Path
from tests.conftest import wait_for

ROOT = Path(__file__).resolve().parents[2]
PY = sys.executable
DRIVER = str(Path(__file__).with_name("driver.py"))


def rolloutd_bin() -> str:
    beside = Path(PY).with_name("rolloutd")
    if beside.exists():
        return str(beside)
    found = shutil.which("rolloutd")
    if not found:
        raise RuntimeError("no rolloutd executable beside the test interpreter or on PATH")
    return found


def free_port(n: int = 1) -> int:
    """A base port with ``n`` consecutive free loopback ports (best effort)."""
    for _ in range(200):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            base = s.getsockname()[1]
        if base + n >= 65000:
            continue
        ok = True
        for p in range(base, base + n):
            with socket.socket() as t:
                try:
                    t.bind(("127.0.0.1", p))
                except OSError:
                    ok = False
                    break
        if ok:
            return base
    raise RuntimeError("no free port range")


def run(cmd, timeout_s: float = 30.0, check: bool = True, **kw) -> subprocess.CompletedProcess:
    r = subprocess.run(cmd, capture_output=True, text=True, timeout=timeout_s, **kw)
    if check and r.returncode != 0:
        raise RuntimeError(f"{cmd} failed ({r.returncode}): {r.stdout}\n{r.stderr}")
    return r


class Proc:
    """A child process in its own session; ``stop()`` sends SIGTERM, then SIGKILL to its group."""

    def __init__(self, cmd, name: str = "", log_path: Path | None = None, env=None, stdout_pipe: bool = False):
        self.name = name or str(cmd[0])
        self.log_path = log_path
        self._log = open(log_path, "wb") if log_path else subprocess.DEVNULL
        self.p = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE if stdout_pipe else self._log,
                                  stderr=self._log, env=env, start_new_session=True)
        self.lines: queue.Queue = queue.Queue()
        if stdout_pipe:
            threading.Thread(target=self._read, daemon=True).start()

    def _read(self):
        for raw in self.p.stdout:
            self.lines.put(raw.decode(errors="replace").rstrip("\n"))
        self.lines.put(None)

    def next_json(self, timeout_s: float):
        """The next stdout line that is JSON, or None at EOF; raises TimeoutError."""
        end = time.monotonic() + timeout_s
        while True:
            left = end - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: no output within {timeout_s}s")
            try:
                line = self.lines.get(timeout=left)
            except queue.Empty:
                raise TimeoutError(f"{self.name}: no output within {timeout_s}s") from None
            if line is None:
                return None
            try:
                return json.loads(line)
            except ValueError:
                continue

    @property
    def pid(self) -> int:
        return self.p.pid

    def alive(self) -> bool:
        return self.p.poll() is None

    def signal(self, sig):
        if self.alive():
            self.p.send_signal(sig)

    def stop(self, timeout_s: float = 15.0) -> int | None:
        if self.alive():
            try:
                self.p.send_signal(signal.SIGTERM)
                self.p.wait(timeout_s)
            except subprocess.TimeoutExpired:
                pass
        try:
            os.killpg(self.p.pid, signal.SIGKILL)  # our own session: the process and whatever it left
        except (ProcessLookupError, PermissionError):
            pass
        try:
            self.p.wait(5.0)
        except subprocess.TimeoutExpired:
            pass
        if self._log is not subprocess.DEVNULL:
            self._log.close()
        if self.p.stdout:
            self.p.stdout.close()
        return self.p.returncode

    def log_text(self) -> str:
        if self.log_path and self.log_path.exists():
            return self.log_path.read_text(errors="replace")
        return ""


class Procs:
    """Processes a test started; ``with Procs() as procs:`` stops them all (last first) at the end."""

    def __init__(self):
        self.items: list[Proc] = []

    def __enter__(self) -> Procs:
        return self

    def __exit__(self, *exc) -> None:
        self.stop_all()

    def start(self, *a, **kw) -> Proc:
        p = Proc(*a, **kw)
        self.items.append(p)
        return p

    def stop_all(self):
        for p in reversed(self.items):
            p.stop()
        self.items.clear()


# -- network namespaces ----------------------------------------------------------------------
def netns_unavailable_reason(bridge: bool = False) -> str | None:
    """None when this process may create network namespaces (with veth pairs, and a bridge
    when asked), else why not."""
    if os.environ.get("ROLLOUTD_TEST_NO_NETNS"):
        return "ROLLOUTD_TEST_NO_NETNS is set"
    if shutil.which("ip") is None:
        return "iproute2 (`ip`) is not installed"
    if os.geteuid() != 0:
        return "network namespaces need root"
    name = f"rtdprobe{os.getpid()}"
    r = subprocess.run(["ip", "netns", "add", name], capture_output=True, text=True)
    if r.returncode != 0:
        return f"`ip netns add` is not permitted here: {r.stderr.strip()}"
    try:
        ok = subprocess.run(["ip", "-n", name, "link", "add", "rtdp0", "type", "veth", "peer", "name", "rtdp1"],
                            capture_output=True, text=True)
        if ok.returncode != 0:
            return f"veth pairs are not available: {ok.stderr.strip()}"
        if bridge:
            ok = subprocess.run(["ip", "-n", name, "link", "add", "rtdpbr", "type", "bridge"],
                                capture_output=True, text=True)
            if ok.returncode != 0:
                return f"bridges are not available: {ok.stderr.strip()}"
        return None
    finally:
        subprocess.run(["ip", "netns", "del", name], capture_output=True)


class NetNS:
    """A network namespace of our own; ``cmd(argv)`` runs argv inside it."""

    def __init__(self, name: str):
        self.name = name
        run(["ip", "netns", "add", name])
        run(["ip", "-n", name, "link", "set", "lo", "up"])

    def cmd(self, argv) -> list[str]:
        return ["ip", "netns", "exec", self.name, *argv]

    def ip(self, *args, check=True):
        return run(["ip", "-n", self.name, *args], check=check)

    def delete(self):
        # Anything still running in it was started by us; the namespace goes when its last user does.
        r = subprocess.run(["ip", "netns", "pids", self.name], capture_output=True, text=True)
        for pid in r.stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except (ProcessLookupError, ValueError):
                pass
        subprocess.run(["ip", "netns", "del", self.name], capture_output=True)


class RootNet:
    """The fallback when namespaces are not permitted: run in the current namespace."""

    name = ""

    def cmd(self, argv) -> list[str]:
        return list(argv)

    def delete(self):
        pass


def isolated_net(tag: str):
    """A private namespace with loopback and one veth pair holding a 10.231.x address (Slurm's
    getaddrinfo uses AI_ADDRCONFIG, which wants a non-loopback address), or the current one."""
    if netns_unavailable_reason() is not None:
        return RootNet()
    ns = NetNS(f"rtd{tag}{os.getpid() % 100000}")
    try:
        ns.ip("link", "add", "rtdv0", "type", "veth", "peer", "name", "rtdv1")
        ns.ip("addr", "add", "10.231.250.1/24", "dev", "rtdv0")
        ns.ip("link", "set", "rtdv0", "up")
        ns.ip("link", "set", "rtdv1", "up")
    except Exception:
        ns.delete()
        raise
    return ns


# -- Slurm ----------------------------------------------------------------------------------------
SLURM_PLUGIN_DIRS = ["/usr/lib/x86_64-linux-gnu/slurm-wlm", "/usr/lib/aarch64-linux-gnu/slurm-wlm",
                     "/usr/lib64/slurm", "/usr/lib/slurm"]


def slurm_unavailable_reason() -> str | None:
    missing = [b for b in ("slurmctld", "slurmd", "sbatch", "squeue", "scancel", "scontrol", "srun")
               if shutil.which(b) is None]
    if missing:
        return f"Slurm is not installed (missing {', '.join(missing)}; apt-get install slurmctld slurmd slurm-client)"
    if os.geteuid() != 0:
        return "the single-node Slurm test runs slurmd as root"
    if slurm_auth() is None:
        return "neither Slurm's auth/none plugin nor munged is available"
    return None


def slurm_plugin(name: str) -> bool:
    return any(Path(d, name + ".so").exists() for d in SLURM_PLUGIN_DIRS)


def slurm_auth() -> str | None:
    forced = os.environ.get("ROLLOUTD_TEST_SLURM_AUTH")
    if forced:
        return forced
    if slurm_plugin("auth_none") and slurm_plugin("cred_none"):
        return "none"
    if shutil.which("munged") and slurm_plugin("auth_munge"):
        return "munge"
    return None


class SlurmCluster:
    """slurmctld and slurmd in the foreground (-D), configured in a temp dir, one node."""

    def __init__(self, workdir: Path, net, procs: Procs, cpus: int = 2):
        self.dir = Path(workdir)
        self.net = net
        self.procs = procs
        self.node = socket.gethostname().split(".")[0]
        for sub in ("state", "spool", "log"):
            (self.dir / sub).mkdir(parents=True, exist_ok=True)
        self.conf = self.dir / "slurm.conf"
        self.env = dict(os.environ, SLURM_CONF=str(self.conf))
        self.auth = slurm_auth()
        ports = (16817, 16818) if isinstance(net, NetNS) else (free_port(1), free_port(1))
        cpus = max(1, min(cpus, os.cpu_count() or 1))
        extra = []
        if self.auth == "munge":
            self._start_munge()
            extra = ["AuthType=auth/munge", "CredType=cred/munge", f"AuthInfo=socket={self.munge_socket}"]
        else:
            extra = ["AuthType=auth/none", "CredType=cred/none"]
        d = self.dir
        lines = [
            "ClusterName=rolloutdtest",
            "SlurmctldHost=localhost(127.0.0.1)",
            f"SlurmctldPort={ports[0]}", f"SlurmdPort={ports[1]}",
            "SlurmUser=root", "SlurmdUser=root", *extra,
            f"StateSaveLocation={d}/state", f"SlurmdSpoolDir={d}/spool",
            f"SlurmctldPidFile={d}/slurmctld.pid", f"SlurmdPidFile={d}/slurmd.pid",
            f"SlurmctldLogFile={d}/log/slurmctld.log", f"SlurmdLogFile={d}/log/slurmd.log",
            f"PlugStackConfig={d}/plugstack.conf",
            "ProctrackType=proctrack/linuxproc", "TaskPlugin=task/none",
            "SelectType=select/cons_tres", "SelectTypeParameters=CR_CPU",
            "SchedulerType=sched/builtin", "MpiDefault=none", "SwitchType=switch/none",
            "JobCompType=jobcomp/none", "AccountingStorageType=accounting_storage/none",
            "JobAcctGatherType=jobacct_gather/none", "ReturnToService=2",
            "KillWait=20", "InactiveLimit=0", "MinJobAge=5", "SlurmdTimeout=30",
            f"NodeName={self.node} NodeAddr=127.0.0.1 CPUs={cpus} State=UNKNOWN",
            "PartitionName=debug Nodes=ALL Default=YES MaxTime=INFINITE State=UP",
        ]
        self.conf.write_text("\n".join(lines) + "\n")
        (d / "plugstack.conf").write_text("")
        # slurmd initializes a cgroup plugin even with proctrack/linuxproc and task/none; cgroup/v1
        # only loads (nothing is mounted or created) when no cgroup plugin is used.
        (d / "cgroup.conf").write_text("CgroupPlugin=cgroup/v1\n")

    def _start_munge(self):
        d = self.dir / "munge"
        d.mkdir(mode=0o700, exist_ok=True)
        key = d / "munge.key"
        key.write_bytes(os.urandom(1024))
        key.chmod(0o400)
        self.munge_socket = d / "munge.socket"
        self.procs.start(self.net.cmd(["munged", "--foreground", "--force", f"--socket={self.munge_socket}",
                                       f"--key-file={key}", f"--pid-file={d / 'munged.pid'}",
                                       f"--log-file={d / 'munged.log'}", f"--seed-file={d / 'munged.seed'}"]),
                         name="munged", log_path=d / "munged.out")
        wait_for(lambda: self.munge_socket.exists(), 10, "munged socket")

    def start(self, timeout_s: float = 30.0):
        self.ctld = self.procs.start(self.net.cmd(["slurmctld", "-D", "-i", "-f", str(self.conf)]), name="slurmctld",
                                     log_path=self.dir / "log" / "slurmctld.out", env=self.env)
        self.slurmd = self.procs.start(self.net.cmd(["slurmd", "-D", "-f", str(self.conf), "-N", self.node]),
                                       name="slurmd", log_path=self.dir / "log" / "slurmd.out", env=self.env)

        def idle():
            if not self.ctld.alive() or not self.slurmd.alive():
                raise RuntimeError(f"Slurm died:\n{self.ctld.log_text()[-2000:]}\n{self.slurmd.log_text()[-2000:]}")
            r = self.sh(["sinfo", "-h", "-N", "-o", "%t"], check=False, timeout_s=10)
            return r.returncode == 0 and r.stdout.strip() in ("idle", "mix")

        wait_for(idle, timeout_s, "the Slurm node to be idle", 0.3)

    def sh(self, argv, check: bool = True, timeout_s: float = 30.0, env=None) -> subprocess.CompletedProcess:
        return run(self.net.cmd(argv), timeout_s=timeout_s, check=check, env=env or self.env)

    def queue(self) -> list[str]:
        r = self.sh(["squeue", "-h", "-o", "%i %T"], check=False)
        return [ln for ln in r.stdout.splitlines() if ln.strip()]

    def job_state(self, job: str) -> str | None:
        """The job's state; "" once it left the queue; None when squeue did not answer."""
        r = self.sh(["squeue", "-h", "-j", job, "-o", "%T"], check=False, timeout_s=15)
        if r.returncode != 0:
            return "" if "Invalid job id" in r.stderr else None
        return r.stdout.strip()

    def logs(self) -> str:
        out = []
        for p in sorted((self.dir / "log").glob("*")):
            out.append(f"== {p.name}\n{p.read_text(errors='replace')[-3000:]}")
        return "\n".join(out)

    def stop(self):
        try:
            self.sh(["scancel", "--full", "-u", "root"], check=False, timeout_s=10)
            wait_for(lambda: not self.queue(), 40, "the Slurm queue to empty", 0.5)
            self.sh(["scontrol", "shutdown"], check=False, timeout_s=10)
        except Exception:  # noqa: BLE001 - tear down regardless
            pass
