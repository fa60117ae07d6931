"""``rolloutd view --serve``: the page on 127.0.0.1, rebuilt from the JSONL on every load.

Loopback only (the results hold task data and model outputs). The page reloads its overview
every ``--refresh`` seconds while a trajectory page stays put. With a gateway address the
header shows its job counts, asked with one ``status`` request per load (never ``poll``: that
would take results away from the trainer that submitted them).
"""
from __future__ import annotations

import io
import os
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from typing import Any

from . import page


def _gateway_line(address: str | None, runtime_dir: str | None) -> str:
    if not address and runtime_dir:
        address = f"ipc://{os.path.join(runtime_dir, 'gateway.sock')}"
    if not address:
        return ""
    if address.startswith("ipc://") and not os.path.exists(address[len("ipc://"):]):
        return f"gateway {address}: no answer (no such socket)"
    try:
        from rolloutd.bus.messages import Status
        from rolloutd.gateway.client import RolloutClient

        with RolloutClient(address, timeout_s=2.0) as c:
            st = c.request(Status(), timeout_s=2.0, retries=0)
    except Exception as e:  # noqa: BLE001 - the page still shows the file
        return f"gateway {address}: no answer ({type(e).__name__})"
    keys = ("queued", "dispatched", "done_unacked")
    return f"gateway {address}: " + " ".join(f"{k}={st.get(k)}" for k in keys if isinstance(st, dict) and k in st)


class _Handler(BaseHTTPRequestHandler):
    server_version = "rolloutd-view"
    ctx: dict[str, Any] = {}

    def log_message(self, fmt, *a):  # quiet: one line per request is noise here
        pass

    def do_GET(self):  # noqa: N802 - http.server's name
        if self.path.split("?")[0] not in ("/", "/index.html"):
            self.send_error(404)
            return
        c = self.ctx
        buf = io.StringIO()
        if Path(c["results"]).is_file():
            live = {"refresh_s": c["refresh"], "status": _gateway_line(c["gateway"], c["runtime_dir"])}
            page.write(c["results"], buf, c["tok"], title="rolloutd: live", tokenizer_name=c["name"],
                       canonical=c["canonical"], live=live)
        else:
            buf.write(f"<!DOCTYPE html><meta http-equiv='refresh' content='{c['refresh']}'>"
                      f"<p>waiting for {c['results']}</p>")
        body = buf.getvalue().encode("utf-8")
        self.send_response(200)
        self.send_header("content-type", "text/html; charset=utf-8")
        self.send_header("content-length", str(len(body)))
        self.send_header("cache-control", "no-store")
        self.end_headers()
        self.wfile.write(body)


def make_server(args, tok, name: str) -> ThreadingHTTPServer:
    handler = type("Handler", (_Handler,), {"ctx": {"results": args.results, "tok": tok, "name": name,
                                                    "canonical": not args.no_canonical, "refresh": args.refresh,
                                                    "gateway": args.gateway, "runtime_dir": args.runtime_dir}})
    srv = ThreadingHTTPServer(("127.0.0.1", args.port), handler)
    srv.daemon_threads = True
    return srv


def serve_forever(args, tok, name: str) -> int:
    srv = make_server(args, tok, name)
    print(f"rolloutd view: serving {args.results} at http://127.0.0.1:{srv.server_address[1]}/ (Ctrl-C to stop)",
          file=sys.stderr, flush=True)
    t = threading.Thread(target=srv.serve_forever, name="view-http", daemon=True)
    t.start()
    try:
        t.join()
    except KeyboardInterrupt:
        pass
    finally:
        srv.shutdown()
        srv.server_close()
    return 0
