"""The tool server's memory under the attacks of issue 35 item 1, this revision and optionally
another one's tool server in the same run (docs/SANDBOX.md "Round 2: bounded tool server").

    .venv/bin/python bench/bench_toolserver_memory.py [--ref-toolserver DIR] [--flood-mb N]

DIR: another revision's sandbox/toolserver, e.g.
    mkdir /tmp/ref && git archive fe23baf sandbox/toolserver | tar -x -C /tmp/ref
    --ref-toolserver /tmp/ref/sandbox/toolserver
Per tool server, in one bwrap sandbox: VmHWM/VmData/threads (/proc/<pid>/status) and the size
of the host-side log, idle; with the LLM relay full (160 connections from inside, each pushing
4 MiB into an endpoint that never reads); after a Python reply-pipe flood of N MiB (default 32).
"""
from __future__ import annotations

import argparse
import os
import shutil
import socket
import sys
import tempfile
import threading
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

import structlog  # noqa: E402

structlog.configure(wrapper_class=structlog.make_filtering_bound_logger(30))

from rolloutd.sandbox import SandboxSpec, ToolClient, ToolTransportError, get_runtime, toollib  # noqa: E402

RELAY = ("import socket\nsocks = []\nfor _ in range(160):\n    try:\n"
         "        s = socket.create_connection(('127.0.0.1', %d)); s.setblocking(False); socks.append(s)\n"
         "    except OSError:\n        pass\nfor s in socks:\n    try:\n        s.send(b'x' * (4 << 20))\n"
         "    except OSError:\n        pass\nlen(socks)")
FLOOD = ("import os, struct\nargs = [a for a in open('/proc/self/cmdline', 'rb').read().split(b'\\0') if a]\n"
         "fd = int(args[-1])\nos.write(fd, struct.pack('!I', %d << 20))\nc = b'\\xff' * (1 << 20)\n"
         "for _ in range(%d):\n    os.write(fd, c)\n")


def status(h) -> dict:
    rows = dict(line.split(":", 1) for line in open("/proc/%d/status" % h.pids[1]).read().splitlines())
    out = {k: int(rows[k].split()[0]) // 1024 for k in ("VmHWM", "VmData")}
    out["threads"] = int(rows["Threads"])
    out["log_bytes"] = os.path.getsize(Path(h.sandbox_dir) / "log")
    return out


def measure(name: str, root: Path, src, flood_mb: int) -> None:
    rt = get_runtime("bwrap", root_dir=root / name)
    own = toollib._SRC
    toollib._SRC = src or own  # the sandbox's tool server is copied from here at create()
    try:
        h = rt.create("mem")
    finally:
        toollib._SRC = own
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    held = []
    try:
        c = ToolClient(h.tool_socket, timeout=120)
        c.call("bash", {"command": "true"})
        c.call("python", {"code": "1"})
        print("%-5s idle        MiB %s" % (name, status(h)), flush=True)
        path = str(Path(h.sandbox_dir) / "run" / "llm.sock")
        srv.bind(path)
        os.chmod(path, 0o666)
        srv.listen(512)

        def accept():
            while True:
                try:
                    held.append(srv.accept()[0])
                except OSError:
                    return
        threading.Thread(target=accept, daemon=True).start()
        port = int(c.call("relay", {"socket": "/run/rolloutd/llm.sock"}).output.rsplit(":", 1)[1])
        c.call("python", {"code": RELAY % port, "timeout": 60})
        end = time.monotonic() + 30
        while len(held) < 128 and time.monotonic() < end:
            time.sleep(0.05)
        print("%-5s relay full  MiB %s (%d relayed)" % (name, status(h), len(held)), flush=True)
        c.call("python", {"code": "[s.close() for s in socks] and None"})
        t0 = time.monotonic()
        try:
            r = c.call("python", {"code": FLOOD % (flood_mb, flood_mb), "timeout": 120})
            what = "tool error: %s" % (r.error or "")[:90]
        except ToolTransportError as e:
            what = "ToolTransportError: %s" % str(e)[-60:]
        print("%-5s flood %d MiB in %.2f s -> %s" % (name, flood_mb, time.monotonic() - t0, what))
        print("%-5s after flood MiB %s" % (name, status(h)), flush=True)
    finally:
        srv.close()
        for s in held:
            s.close()
        rt.destroy(h)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--ref-toolserver", type=Path, metavar="DIR")
    ap.add_argument("--flood-mb", type=int, default=32)
    ap.add_argument("--quick", action="store_true", help="make bench-smoke: an 8 MiB flood")
    ns = ap.parse_args()
    if ns.quick:
        ns.flood_mb = 8
    root = Path(tempfile.mkdtemp(prefix="rldm", dir="/tmp"))
    os.chmod(root, 0o755)
    try:
        measure("ours", root, None, ns.flood_mb)
        if ns.ref_toolserver:
            measure("ref", root, ns.ref_toolserver, ns.flood_mb)
    finally:
        shutil.rmtree(root, ignore_errors=True)


if __name__ == "__main__":
    main()
