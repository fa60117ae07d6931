"""systemd units and Slurm launch scripts for rolloutd, shipped as package data.

Units are templates keyed by the *deployment* name (the instance, ``main`` by default), so
one host can run several independent deployments side by side:

=============================  ===============================================================
``rolloutd-events@.service``   events stream (head)
``rolloutd-router@.service``   LLM backend router (head)
``rolloutd-gateway@.service``  gateway, job table, journal (head)
``rolloutd-eval@.service``     eval phase daemon (every worker node)
``rolloutd-run@.service``      run phase daemon (every worker node)
``rolloutd-init@.service``     init phase daemon (every worker node)
``rolloutd-head@.target``      events + router + gateway
``rolloutd-worker@.target``    eval + run + init
``rolloutd@.target``           head + worker (a one-machine deployment)
``rolloutd-exporter@.service`` Prometheus exporter (optional, in no target)
=============================  ===============================================================

Each unit reads ``/etc/rolloutd/<instance>.toml`` (``ROLLOUTD_CONFIG``), optionally
``/etc/rolloutd/<instance>.env`` (``ROLLOUTD_CONFIG=...``, ``ROLLOUTD_ARGS=...``), and
puts its ipc sockets in ``/run/rolloutd/<instance>``. The files name
``/usr/local/bin/rolloutd``; ``python -m rolloutd.systemd install`` writes copies whose ExecStart
names the ``rolloutd`` actually installed (a virtualenv, say). See docs/OPERATIONS.md.
"""
from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

HERE = Path(__file__).resolve().parent
SLURM_DIR = HERE / "slurm"
DEFAULT_BIN = "/usr/local/bin/rolloutd"
HEAD = ("events", "router", "gateway")
WORKER = ("eval", "run", "init")
DAEMONS = HEAD + WORKER
TARGETS = ("rolloutd-head@.target", "rolloutd-worker@.target", "rolloutd@.target")

EXAMPLE_CONFIG = """\
# /etc/rolloutd/{instance}.toml: one file for every node of the deployment (see docs/OPERATIONS.md).
# `node` defaults to the host name. The units force endpoints.runtime_dir to /run/rolloutd/{instance};
# it is repeated here so that `rolloutd status|monitor|exporter --config` read the same file.

keys_dir = "/etc/rolloutd/keys"          # CURVE keys (`rolloutd keys generate`); "" disables CURVE

[endpoints]
head = "{head}"                          # host the worker nodes reach the head daemons at
base_port = 5550                         # gateway 5550, gateway_results 5551, init 5552,
                                         # router 5553, events_in 5554, events_out 5555
runtime_dir = "/run/rolloutd/{instance}"        # node-local ipc sockets (init -> run -> eval)

[daemon]
heartbeat_s = 1.0
drain_s = 10.0                           # keep below the units' TimeoutStopSec (30 s)

[gateway]
journal = "/var/lib/rolloutd/{instance}/journal.sqlite"
daemon_dead_s = 5.0

[sandbox]
root_dir = "/var/lib/rolloutd/{instance}/sandboxes"
"""


def unit_files() -> list[Path]:
    """Every unit file shipped (templates), services first."""
    return sorted(HERE.glob("*.service")) + [HERE / t for t in TARGETS]


def instance_name(template: str, instance: str) -> str:
    """``rolloutd-run@.service`` -> ``rolloutd-run@main.service``."""
    return template.replace("@.", f"@{instance}.", 1)


def render(text: str, rolloutd_bin: str | os.PathLike | None = None) -> str:
    """A unit's text with ExecStart pointing at ``rolloutd_bin``."""
    if rolloutd_bin is None:
        return text
    return text.replace(f"ExecStart={DEFAULT_BIN} ", f"ExecStart={os.fspath(rolloutd_bin)} ")


def find_rolloutd() -> str:
    """The ``rolloutd`` next to this interpreter (a venv), else the one on PATH."""
    beside = Path(sys.executable).with_name("rolloutd")
    if beside.is_file() and os.access(beside, os.X_OK):
        return str(beside)
    found = shutil.which("rolloutd")
    if found:
        return found
    raise FileNotFoundError("no rolloutd executable beside this python or on PATH; pass --bin")


def shard_unit_name(shard: int) -> str:
    """Router shard ``shard`` >= 1's unit: ``rolloutd-router1@.service``, ... (shard 0 is the router's)."""
    return f"rolloutd-router{shard}@.service"


def shard_units(router_shards: int) -> dict[str, str]:
    """``router.shards`` = K > 1 (docs/SCALING.md, "Router shards"): a unit for each shard 1..K-1,
    the router's with ``--shard i``, and the head target wanting them too. Made at install time,
    not shipped: K is the deployment's."""
    if router_shards <= 1:
        return {}
    router = (HERE / "rolloutd-router@.service").read_text()
    cmd = f"ExecStart={DEFAULT_BIN} router "
    assert cmd in router, "the router unit's ExecStart moved: update shard_units"
    out = {}
    for i in range(1, router_shards):
        text = router.replace(cmd, f"ExecStart={DEFAULT_BIN} router --shard {i} ", 1)
        text = text.replace("# rolloutd: router daemon,", f"# rolloutd: router shard {i} (made by `install --router-shards`),", 1)
        text = text.replace("Description=rolloutd router (%i):", f"Description=rolloutd router shard {i} (%i):", 1)
        text = text.replace("SyslogIdentifier=rolloutd-router\n", f"SyslogIdentifier=rolloutd-router{i}\n", 1)
        out[shard_unit_name(i)] = text
    head = (HERE / "rolloutd-head@.target").read_text()
    wants = " ".join(instance_name(n, "%i") for n in out)
    out["rolloutd-head@.target"] = head.replace("rolloutd-router@%i.service", f"rolloutd-router@%i.service {wants}", 1)
    return out


def write_units(dest: str | os.PathLike, rolloutd_bin: str | os.PathLike | None = None,
                router_shards: int = 1) -> list[Path]:
    """Write every unit into ``dest`` with ExecStart rewritten, and a unit per router shard beyond
    the first (``router_shards``); returns the written paths."""
    d = Path(dest)
    d.mkdir(parents=True, exist_ok=True)
    texts = {src.name: src.read_text() for src in unit_files()}
    texts.update(shard_units(router_shards))
    out = []
    for name, text in texts.items():
        p = d / name
        p.write_text(render(text, rolloutd_bin))
        p.chmod(0o644)
        out.append(p)
    return out


def verify(unit_dir: str | os.PathLike, instance: str = "main", router_shards: int = 1) -> tuple[int, str]:
    """``systemd-analyze verify`` every unit of ``unit_dir`` as ``instance``; (rc, output)."""
    exe = shutil.which("systemd-analyze")
    if exe is None:
        raise FileNotFoundError("systemd-analyze is not installed")
    d = Path(unit_dir)
    names = [str(d / instance_name(p.name, instance)) for p in unit_files()]
    names += [str(d / instance_name(shard_unit_name(i), instance)) for i in range(1, router_shards)]
    env = dict(os.environ, SYSTEMD_LOG_COLOR="0", SYSTEMD_PAGER="")
    r = subprocess.run([exe, "verify", "--man=no", *names], capture_output=True, text=True, env=env, timeout=120)
    return r.returncode, (r.stdout + r.stderr).strip()


def slurm_launcher() -> Path:
    return SLURM_DIR / "rolloutd-slurm.sh"


def slurm_batch() -> Path:
    return SLURM_DIR / "rolloutd.sbatch"
