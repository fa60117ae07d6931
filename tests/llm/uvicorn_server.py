"""uvicorn serving a test's (or a benchmark's) ASGI app on 127.0.0.1, on a port of its own, the
two ways the tests and bench/bench_transport.py run it: in a thread of this process
(:class:`ThreadedUvicorn`), or in a child process that runs :func:`serve_printing_port` and that
the parent waits for with :func:`wait_ready` (the ``READY <port>`` line)."""

from __future__ import annotations

import asyncio
import select
import socket
import subprocess
import threading
import time


def quiet_config(app, **kw):
    """A uvicorn.Config with no lifespan and no access log (test and bench output stay readable)."""
    import uvicorn

    return uvicorn.Config(app, lifespan="off", log_level="warning", access_log=False, **kw)


async def read_body(receive) -> bytes | None:
    """The whole ASGI request body, or None if the client disconnected first."""
    parts = []
    while True:
        m = await receive()
        if m["type"] == "http.disconnect":
            return None
        parts.append(m.get("body", b""))
        if not m.get("more_body"):
            return b"".join(parts)


class ThreadedUvicorn:
    """uvicorn in a thread (its own loop) serving ``app``; ``url``, and ``stop()`` checks it stopped."""

    def __init__(self, app, start_timeout: float = 30.0, **config_kw) -> None:
        import uvicorn

        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server = uvicorn.Server(quiet_config(app, **config_kw))
        self.thread = threading.Thread(target=self.server.run, kwargs={"sockets": [self.sock]}, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + start_timeout
        while not self.server.started and self.thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.005)
        if not self.server.started:
            self.stop()
            raise RuntimeError("uvicorn did not start")

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(timeout=15)
        self.sock.close()
        assert not self.thread.is_alive(), "uvicorn thread did not stop"


def serve_printing_port(server, port: int = 0) -> None:
    """Child side: run ``server`` (a uvicorn.Server) on 127.0.0.1:``port`` and print ``READY <port>``
    once it listens; returns when it exits (or failed to start)."""
    sock = socket.socket()
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", port))

    async def main() -> None:
        task = asyncio.create_task(server.serve(sockets=[sock]))
        while not server.started:
            if task.done():
                return await task
            await asyncio.sleep(0.005)
        print(f"READY {sock.getsockname()[1]}", flush=True)
        await task

    asyncio.run(main())


def wait_ready(proc: subprocess.Popen, timeout: float = 30.0) -> int | None:
    """Parent side: the port of the child's ``READY <port>`` line on its stdout, or None if the
    child exited or ``timeout`` passed first (the caller stops it and says why)."""
    deadline = time.monotonic() + timeout
    line = b""
    while not line.startswith(b"READY"):
        left = deadline - time.monotonic()
        if left <= 0 or proc.poll() is not None:
            return None
        if select.select([proc.stdout], [], [], left)[0]:
            line = proc.stdout.readline()
    return int(line.split()[1])
