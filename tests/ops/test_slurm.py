"""A real single-node Slurm (slurmctld + slurmd in the foreground, configured in a temp dir)
runs systemd/slurm/rolloutd.sbatch; a trainer submits jobs to the gateway it started; then
the job is stopped the way the time limit stops it (SIGTERM to the batch script) and every
daemon must exit in pipeline order, leaving nothing behind."""
from __future__ import annotations

import json
import os
import re
import shutil
import signal
import tempfile
from pathlib import Path

import pytest

from rolloutd import systemd as units

from .helpers import (DRIVER, PY, SlurmCluster, free_port, isolated_net, rolloutd_bin, run, slurm_unavailable_reason,
                      wait_for)

DAEMONS = ("events", "router", "gateway", "eval", "run", "init")


def launcher_events(text: str) -> list[dict]:
    out = []
    for ln in text.splitlines():
        if '"daemon": "slurm-launcher"' in ln:
            try:
                out.append(json.loads(ln))
            except ValueError:
                pass
    return out


def processes_mentioning(needle: str) -> list[int]:
    pids = []
    for d in Path("/proc").iterdir():
        if not d.name.isdigit() or int(d.name) == os.getpid():
            continue
        try:
            cmd = (d / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue
        if needle in cmd:
            pids.append(int(d.name))
    return pids


def test_launcher_refuses_outside_an_allocation():
    env = {k: v for k, v in os.environ.items() if not k.startswith("SLURM_")}
    r = run(["bash", str(units.slurm_launcher()), "node"], check=False, env=env)
    assert r.returncode == 1 and "not inside a Slurm allocation" in r.stderr
    r = run(["bash", str(units.slurm_launcher()), "bogus"], check=False, env=env)
    assert r.returncode == 2


@pytest.mark.parametrize("shards", [1, 2], ids=["one-router", "two-router-shards"])
def test_sbatch_runs_the_pipeline_and_stops_it(procs, shards):
    reason = slurm_unavailable_reason()
    if reason:
        pytest.skip(reason)
    d = Path(tempfile.mkdtemp(prefix="rtd-slurm-"))
    net = isolated_net("s")
    cluster = None
    try:
        cluster = SlurmCluster(d / "slurm", net, procs)
        cluster.start()
        port = 17550 if net.name else free_port(6)
        rt = d / "rt"
        info = d / "info.json"
        out = d / "job.out"
        env = dict(cluster.env, ROLLOUTD_BIN=rolloutd_bin(), ROLLOUTD_BASE_PORT=str(port),
                   ROLLOUTD_INFO_FILE=str(info), ROLLOUTD_RUNTIME_DIR=str(rt), ROLLOUTD_DRAIN_S="2",
                   ROLLOUTD_SET="daemon.heartbeat_s=0.3 gateway.daemon_dead_s=2", ROLLOUTD_ROUTER_SHARDS=str(shards))
        daemons = list(DAEMONS) + [f"router{i}" for i in range(1, shards)]
        env.pop("ROLLOUTD_CONFIG", None)
        r = cluster.sh(["sbatch", "--parsable", "--nodes=1", "--time=10", f"--output={out}", f"--chdir={d}",
                        str(units.slurm_batch())], env=env)
        job = r.stdout.strip().split(";")[0]
        assert job.isdigit(), r.stdout

        def started():
            if info.exists():
                return json.loads(info.read_text())
            if cluster.job_state(job) == "":   # squeue answered and the job is gone
                raise AssertionError(f"job {job} ended early:\n{out.read_text() if out.exists() else ''}\n"
                                     f"{cluster.logs()}")
            return None

        meta = wait_for(started, 60, "the head to write its info file", 0.3)
        assert meta["gateway"] == f"tcp://127.0.0.1:{port}" and meta["head_node"] == cluster.node
        assert meta["job_id"] == job

        # A daemon that dies is restarted by the node launcher.
        def spawned():   # task output reaches the file through srun, a little after the info file
            got = {e["child"]: e["pid"] for e in launcher_events(out.read_text()) if e["event"] == "daemon_spawned"}
            return got if set(got) == set(daemons) else None

        spawned = wait_for(spawned, 20, "the launcher's daemon_spawned lines")
        os.kill(spawned["run"], signal.SIGKILL)
        wait_for(lambda: any(e["event"] == "daemon_restarted" and e["child"] == "run"
                             for e in launcher_events(out.read_text())), 20, "the run daemon to be restarted")

        # A trainer submits through the gateway the allocation started.
        r = run(net.cmd([PY, DRIVER, "--gateway", meta["gateway"], "--jobs", "8", "--instance",
                         json.dumps({"run": 0.2, "init": 0.05}), "--ready-timeout", "60", "--deadline", "60"]),
                timeout_s=150, check=False)
        lines = [json.loads(ln) for ln in r.stdout.splitlines() if ln.startswith("{")]
        assert r.returncode == 0, f"{r.stdout}\n{r.stderr}\n{out.read_text()}"
        results = [x for x in lines if "job_id" in x]
        assert len(results) == 8
        assert {x["status"] for x in results} == {"ok"}
        assert {x["node"] for x in results} == {cluster.node}
        assert cluster.job_state(job) == "RUNNING"

        # The time-limit path: Slurm signals the batch script (--signal=B:TERM@...); the script
        # forwards to srun, srun to each node's launcher, which stops the daemons in order.
        cluster.sh(["scancel", "--batch", "--signal=TERM", job])
        wait_for(lambda: cluster.job_state(job) == "", 60, "the job to end by itself", 0.5)
        text = out.read_text()
        ev = launcher_events(text)
        exited = [e["child"] for e in ev if e["event"] == "daemon_exited" and e.get("rc") == 0]
        stop_seq = [c for c in exited if c in daemons][-len(daemons):]
        shards_down = [f"router{i}" for i in range(shards - 1, 0, -1)]
        assert stop_seq == ["init", "run", "eval", "gateway", *shards_down, "router", "events"], ev
        assert any(e["event"] == "node_stopped" for e in ev)
        for name in daemons:
            assert re.search(rf"daemon_stopped.*(daemon={name}\b|\"daemon\": \"{name}\")", text) or \
                re.search(rf"(daemon={name}\b|\"daemon\": \"{name}\").*daemon_stopped", text), name
        assert not rt.exists(), "the runtime directory should be removed"
        assert not info.exists(), "the info file should be removed with the deployment"
        assert processes_mentioning(str(rt)) == []
    finally:
        if cluster is not None:
            cluster.stop()
        procs.stop_all()
        net.delete()
        if not os.environ.get("ROLLOUTD_TEST_KEEP"):
            shutil.rmtree(d, ignore_errors=True)
