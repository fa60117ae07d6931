"""A trainer stand-in the ops tests run where the gateway is reachable (inside a network
namespace, say): waits for the service, submits synthetic jobs, prints one JSON line per
result as it arrives, then a final summary line. Every wait is bounded."""
from __future__ import annotations

import argparse
import json
import sys
import time


def emit(obj):
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--gateway", required=True)
    p.add_argument("--keys-dir", default="")
    p.add_argument("--key-name", default="client")
    p.add_argument("--jobs", type=int, default=8)
    p.add_argument("--instance", default='{"run": 0.2}', help="synthetic handler instance (JSON)")
    p.add_argument("--ready-nodes", type=int, default=1, help="wait until this many nodes run every phase daemon")
    p.add_argument("--ready-timeout", type=float, default=60.0)
    p.add_argument("--deadline", type=float, default=120.0)
    p.add_argument("--request-timeout", type=float, default=3.0)
    p.add_argument("--status-only", action="store_true")
    a = p.parse_args(argv)

    from rolloutd.gateway.client import GatewayTimeout, RolloutClient

    curve = None
    if a.keys_dir:
        from rolloutd.bus.sockets import Curve

        curve = Curve.from_dir(a.keys_dir, a.key_name)
    with RolloutClient(a.gateway, timeout_s=a.request_timeout, retries=1, curve=curve) as c:
        end = time.monotonic() + a.ready_timeout
        st = None
        while True:
            try:
                st = c.status()
                nodes = {}
                for d in st.get("daemons", []):
                    nodes.setdefault(d.get("node"), set()).add(d.get("daemon"))
                full = [n for n, ds in nodes.items() if {"init", "run", "eval"} <= ds]
                if len(full) >= a.ready_nodes:
                    break
            except GatewayTimeout:
                pass
            if time.monotonic() > end:
                emit({"error": "not ready", "status": st})
                return 3
            time.sleep(0.2)
        emit({"ready": True, "nodes": sorted(full), "t": time.time()})
        if a.status_only:
            emit({"status": st})
            return 0
        inst = json.loads(a.instance)
        ids = c.submit([{"handler": "synthetic", "instance": inst}], n=a.jobs)
        emit({"submitted": ids, "t": time.time()})
        got = 0
        try:
            for r in c.gather(ids, timeout_s=a.deadline, wait_s=0.5):
                got += 1
                emit({"job_id": r["job_id"], "status": r["status"], "node": r.get("node"),
                      "attempts": r.get("attempts"), "error": r.get("error"), "timing": r.get("timing"),
                      "t": time.time()})
        except GatewayTimeout as e:
            emit({"error": f"gather: {e}", "got": got})
            return 4
        emit({"done": True, "n": got, "t": time.time()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
