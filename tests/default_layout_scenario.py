"""Run by tests/test_default_layout.py inside a private mount namespace with an empty /tmp:
`rolloutd up` on its defaults (root, no XDG_RUNTIME_DIR, no ROLLOUTD_*), one sandboxed `code`
job to `ok`; then, with the first deployment's private runtime directory left behind, a second
deployment on the default sandbox root whose job and janitor must still work.

Prints one JSON line with what it saw; exits non-zero on the first failure."""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from rolloutd.bus.config import Config
from rolloutd.daemons.supervisor import wait_ready
from rolloutd.gateway.client import RolloutClient
from rolloutd.handlers.oracles import Oracle
from rolloutd.backends.scripted import ScriptedBackend
from rolloutd.sandbox import get_runtime
from rolloutd.sandbox.procs import is_running


def up(*args: str, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "rolloutd.daemons.cli", "up", *args],
                            stdout=open(log, "w"), stderr=subprocess.STDOUT)


def stop(p: subprocess.Popen) -> None:
    p.send_signal(signal.SIGTERM)
    try:
        p.wait(60)
    except subprocess.TimeoutExpired:
        p.kill()
        p.wait(10)
        raise SystemExit("rolloutd up did not stop within 60 s")


def code_job(address: str, backend_url: str, tok_dir: str, cli_add: bool) -> dict:
    if cli_add:  # the way the user did it
        subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "backend", "add", backend_url],
                       check=True, capture_output=True, timeout=60)
    with RolloutClient(address, timeout_s=30) as c:
        if not cli_add:
            c.add_backend(backend_url)
        ids = c.submit([{"handler": "code", "instance_id": "c0",
                         "instance": {"task_id": "HumanEval/0", "tokenizer": tok_dir}}])
        (res,) = list(c.gather(ids, timeout_s=180))
    return res


def main() -> int:
    tok_dir, work = sys.argv[1], Path(sys.argv[2])
    assert "XDG_RUNTIME_DIR" not in os.environ and not any(k.startswith("ROLLOUTD_") for k in os.environ)
    pol = Oracle(wrong_every=1000)
    pol.warm()
    backend = ScriptedBackend(tok_dir, policy=pol)
    backend.start()
    seen: dict = {}
    try:
        # 1. the defaults: runtime dir /tmp/rolloutd-<uid>, sandbox root under /tmp/rolloutd-sandboxes-<uid>
        cfg = Config.load(None)
        seen["runtime_dir"], seen["sandbox_root"] = str(cfg.runtime_dir), str(cfg.sandbox_root())
        first = up(log=work / "up1.log")
        try:
            wait_ready(cfg.endpoints.gateway, 60)
            seen["runtime_dir_mode"] = oct(cfg.runtime_dir.stat().st_mode & 0o777)
            r = code_job(cfg.endpoints.gateway, backend.url, tok_dir, cli_add=True)
            seen["first"] = {"status": r["status"], "error": r["error"], "reward": r["reward"]}
        finally:
            stop(first)
        # 2. another deployment on the default sandbox root, after the default one made its
        #    runtime directory private (and, under the old layout, the sandbox root's parent with
        #    it): its sandboxes and its janitor must work
        second_rt = Path("/tmp/rd-second/run")
        cfg2 = Config({"endpoints": {"runtime_dir": str(second_rt)}})
        second = up("--runtime-dir", str(second_rt), "--set", "sandbox.janitor_interval_s=0.5",
                    "--set", "sandbox.janitor_grace_s=1", log=work / "up2.log")
        try:
            wait_ready(cfg2.endpoints.gateway, 60)
            r = code_job(cfg2.endpoints.gateway, backend.url, tok_dir, cli_add=False)
            seen["second"] = {"status": r["status"], "error": r["error"], "reward": r["reward"]}
            rt = get_runtime("bwrap", root_dir=cfg2.sandbox_root())
            orphan = rt.create("424242.1")
            deadline = time.monotonic() + 30
            while rt.list() and time.monotonic() < deadline:
                time.sleep(0.2)
            seen["orphan_reaped"] = not rt.list()
            seen["orphan_pids_alive"] = [p for p in orphan.pids if is_running(p)]  # zombies of ours are dead
        finally:
            stop(second)
    finally:
        backend.stop()
    print(json.dumps(seen))
    return 0


if __name__ == "__main__":
    sys.exit(main())
