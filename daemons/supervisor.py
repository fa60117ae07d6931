"""``rolloutd up``: every daemon of one machine as a supervised child process.

Children start receivers first (events, router, gateway, eval, run, init) and stop one at a
time in the order of the pipeline's flow (init, run, eval drain first, each handing its work
on to the next, still running; then gateway, router, and events last, so every other daemon's
stop notice is published), each with SIGTERM and a deadline before SIGKILL. Each child runs
in its own process group, so a terminal's Ctrl-C reaches only the supervisor. A child that dies is restarted
with backoff, and the restart is logged. Children get PR_SET_PDEATHSIG, so a killed
supervisor leaves no orphans. On exit the ipc files and the written config are removed.
With ``router.shards`` = K > 1, "router" stands for K processes (router, router1, ...), started
and stopped together where the router would be (docs/SCALING.md, "Router shards").
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

from rolloutd.bus import logs
from rolloutd.bus.config import Config, dump_toml
from rolloutd.bus.endpoints import router_ipc_paths, router_name, router_shard
from rolloutd.daemons.children import die_with_parent

START_ORDER = ["events", "router", "gateway", "eval", "run", "init"]
STOP_ORDER = ["init", "run", "eval", "gateway", "router", "events"]


def _child_setup():  # runs in the child between fork and exec
    # Its own process group: a terminal's Ctrl-C (SIGINT to the foreground group) or a kill of
    # the group reaches only the supervisor, which stops the children in order. Signalled all at
    # once, the events daemon went first and every other daemon's stop notice reached nobody.
    os.setpgid(0, 0)
    die_with_parent()


def with_shards(names: list[str], shards: int) -> list[str]:
    """``names`` with "router" standing for every router shard."""
    out = []
    for n in names:
        out += [router_name(i) for i in range(shards)] if n == "router" else [n]
    return out


class Supervisor:
    def __init__(self, cfg: Config, daemons: list[str] | None = None):
        self.cfg = cfg
        self.shards = int(cfg.section("router")["shards"])
        self.names = with_shards(daemons or START_ORDER, self.shards)
        self.procs: dict[str, subprocess.Popen] = {}
        self.restarts: dict[str, int] = {n: 0 for n in self.names}
        self.next_start: dict[str, float] = {}
        self.started: dict[str, float] = {}
        self.stopping = False
        self.log = logs.get("rolloutd.supervisor").bind(daemon="supervisor", node=cfg.node)
        self.config_path = cfg.runtime_dir / "config.toml"

    def write_config(self):
        rd = self.cfg.runtime_dir
        rd.mkdir(parents=True, exist_ok=True, mode=0o700)
        os.chmod(rd, 0o700)  # ipc sockets are protected by the directory's permissions
        data = dict(self.cfg.data)
        data["node"] = self.cfg.node
        data["endpoints"] = dict(self.cfg.endpoints.to_config(), runtime_dir=str(rd))
        self.config_path.write_text(dump_toml(data))

    def spawn(self, name: str):
        cmd = [sys.executable, "-m", "rolloutd.daemons.cli", name, "--config", str(self.config_path)]
        shard = router_shard(name)
        if shard:  # router1, router2, ...: the router command with its shard
            cmd[3:4] = ["router", "--shard", str(shard)]
        self.procs[name] = subprocess.Popen(cmd, preexec_fn=_child_setup, stdin=subprocess.DEVNULL)
        self.started[name] = time.monotonic()
        self.log.info("daemon_spawned", child=name, pid=self.procs[name].pid)

    def start(self):
        self.write_config()
        for name in self.names:
            self.spawn(name)

    def check(self):
        """Restart children that died (with exponential backoff, capped at 10 s)."""
        now = time.monotonic()
        for name, p in list(self.procs.items()):
            rc = p.poll()
            if rc is None or self.stopping:
                continue
            due = self.next_start.get(name)
            if due is None:
                n = self.restarts[name]
                delay = min(10.0, 0.2 * (2 ** n)) if n else 0.0
                self.next_start[name] = now + delay
                self.log.warning("daemon_exited", child=name, rc=rc, restart_in_s=delay)
                continue
            if now >= due:
                del self.next_start[name]
                self.restarts[name] += 1
                self.spawn(name)
                self.log.warning("daemon_restarted", child=name, restarts=self.restarts[name])
        # A child that has stayed up a minute has its backoff forgiven.
        for name, t in list(self.started.items()):
            if self.restarts[name] and now - t > 60.0 and self.procs[name].poll() is None:
                self.restarts[name] = 0

    def stop(self):
        self.stopping = True
        drain = float(self.cfg.section("daemon")["drain_s"])
        for name in with_shards(STOP_ORDER, self.shards):
            p = self.procs.get(name)
            if p is None or p.poll() is not None:
                continue
            p.send_signal(signal.SIGTERM)
            try:
                p.wait(drain + 5.0)
            except subprocess.TimeoutExpired:
                self.log.error("daemon_killed", child=name, reason="did not stop within the drain deadline")
                p.kill()
                p.wait(5.0)
        self.cleanup()

    def cleanup(self):
        for path in self.cfg.endpoints.ipc_paths() + router_ipc_paths(self.cfg.endpoints, self.shards):
            path.unlink(missing_ok=True)
        self.config_path.unlink(missing_ok=True)
        for d in (self.cfg.runtime_dir,):
            try:
                d.rmdir()  # only when empty: never delete what someone else put there
            except OSError:
                pass

    def run(self) -> int:
        """Supervise until SIGTERM/SIGINT; returns the exit code."""
        got = []

        def on_signal(signum, frame):
            got.append(signum)

        signal.signal(signal.SIGTERM, on_signal)
        signal.signal(signal.SIGINT, on_signal)
        self.start()
        self.log.info("rolloutd_up", gateway=self.cfg.endpoints.gateway, events=self.cfg.endpoints.events_out,
                      runtime_dir=str(self.cfg.runtime_dir), config=str(self.config_path))
        try:
            while not got:
                self.check()
                time.sleep(0.1)
        finally:
            self.log.info("rolloutd_stopping", signal=signal.Signals(got[0]).name if got else None)
            self.stop()
        self.log.info("rolloutd_stopped")
        return 0


def wait_ready(address: str, timeout_s: float = 30.0) -> dict:
    """Block until the gateway answers a status request (used by the CLI and tests)."""
    from rolloutd.gateway.client import GatewayTimeout, RolloutClient

    deadline = time.monotonic() + timeout_s
    with RolloutClient(address, timeout_s=1.0, retries=0) as c:
        while True:
            try:
                st = c.status()
                phases = {d.get("daemon") for d in st.get("daemons", [])}
                if {"init", "run", "eval"} <= phases:
                    return st
            except GatewayTimeout:
                pass
            if time.monotonic() > deadline:
                raise TimeoutError(f"rolloutd at {address} not ready after {timeout_s}s")
            time.sleep(0.1)


def config_from_args(path: str | None, runtime_dir: str | None, sets: list[str]) -> Config:
    cfg = Config.load(path)
    data = cfg.data
    if runtime_dir:  # keeps head/base_port/explicit names; the ipc ones move to runtime_dir
        data["endpoints"] = dict(data.get("endpoints") or {}, runtime_dir=runtime_dir)
    for item in sets or []:
        key, _, raw = item.partition("=")
        section, *path = key.split(".")
        if not path:
            data[section] = _parse(raw)
            continue
        node = data.setdefault(section, {})
        for p in path[:-1]:  # handlers.math.tokenizer=X nests
            node = node.setdefault(p, {})
        node[path[-1]] = _parse(raw)
    return Config({k: v for k, v in data.items()}, cfg.path)


def _parse(raw: str):
    import json

    try:
        return json.loads(raw)
    except ValueError:
        return raw
