"""The LLM relay relays a bounded number of connections at once: an agent that opens thousands
of connections gets resets past the bound instead of two tool-server threads each (an earlier
run left a tool server with 11,459 threads and the node at load 4,000)."""
from __future__ import annotations

import socket
import tempfile
import threading
import time
import os

from rolloutd.sandbox.toolserver.relay import Relay
from tests.conftest import wait_for


def _echo_server(path: str):
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(512)
    stop = threading.Event()

    def serve(c):
        with c:
            while True:
                try:
                    d = c.recv(4096)
                except OSError:
                    return
                if not d:
                    return
                c.sendall(d)

    def loop():
        while not stop.is_set():
            try:
                c, _ = srv.accept()
            except OSError:
                return
            threading.Thread(target=serve, args=(c,), daemon=True).start()

    threading.Thread(target=loop, daemon=True).start()
    return srv, stop


def _relay_threads() -> int:
    return sum(t.name in ("relay-conn", "relay-down") for t in threading.enumerate())


def test_connections_past_the_bound_are_reset_and_cost_no_threads():
    d = tempfile.mkdtemp(prefix="rd-relay-")
    path = os.path.join(d, "llm.sock")
    srv, stop = _echo_server(path)
    relay = Relay(path, max_open=8)
    port = relay.start()
    held = []
    try:
        reset_at_connect = 0
        for _ in range(60):
            try:
                held.append(socket.create_connection(("127.0.0.1", port), timeout=10))
            except ConnectionResetError:  # the relay's reset can beat connect() back to us
                reset_at_connect += 1
        wait_for(lambda: relay.connections == 60, 30, what="every connection accepted")
        assert relay.refused == 52
        assert _relay_threads() <= 16
        # the first eight relay; the others were reset (recv sees the reset or EOF, never a hang)
        for c in held[:8]:
            c.sendall(b"ping")
            assert c.recv(4) == b"ping"
        assert len(held) + reset_at_connect == 60
        for c in held[8:]:
            try:
                got = c.recv(4)
            except ConnectionResetError:
                got = b""
            assert got == b""
        for c in held:
            c.close()
        wait_for(lambda: relay.info()["open"] == 0, 30, what="the relayed connections to close")
        # slots come back: a new connection relays again
        with socket.create_connection(("127.0.0.1", port), timeout=10) as c:
            c.sendall(b"again")
            assert c.recv(5) == b"again"
    finally:
        for c in held:
            c.close()
        relay.stop()
        stop.set()
        srv.close()
        os.unlink(path)
        os.rmdir(d)


def test_an_early_answer_reaches_a_client_still_sending():
    """A server that answers before reading the whole body (413 from Content-Length) and closes:
    the relay keeps delivering the answer while it drops the rest of the upload, so the client
    reads the 413, not a reset (the endpoint isolation test's 8 MB attacker saw 'closed')."""
    d = tempfile.mkdtemp(prefix="rd-relay-")
    path = os.path.join(d, "llm.sock")
    srv = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    srv.bind(path)
    srv.listen(8)
    answer = b"HTTP/1.1 413 Request Entity Too Large\r\ncontent-length: 0\r\nconnection: close\r\n\r\n"

    def serve():
        c, _ = srv.accept()
        with c:
            buf = b""
            while b"\r\n\r\n" not in buf:
                buf += c.recv(4096)
            # Stop reading first (the relay's next write of the body fails), answer a moment
            # later: the order that lost the answer when a failed write cut both directions.
            c.shutdown(socket.SHUT_RD)
            time.sleep(0.5)
            c.sendall(answer)  # and close with the body unread

    t = threading.Thread(target=serve, daemon=True)
    t.start()
    relay = Relay(path)
    port = relay.start()
    try:
        body = b"x" * (8 << 20)
        with socket.create_connection(("127.0.0.1", port), timeout=60) as c:
            c.sendall(b"POST / HTTP/1.1\r\nHost: x\r\nContent-Length: %d\r\n\r\n" % len(body))
            try:
                c.sendall(body)
            except OSError:
                pass
            got = b""
            try:
                while True:
                    chunk = c.recv(65536)
                    if not chunk:
                        break
                    got += chunk
            except ConnectionResetError:
                pass
        assert got.startswith(b"HTTP/1.1 413"), got[:80]
    finally:
        relay.stop()
        srv.close()
        t.join(10)
        os.unlink(path)
        os.rmdir(d)
