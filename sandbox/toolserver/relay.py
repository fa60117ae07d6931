"""TCP-to-Unix-socket relay: how an agent in a sandbox without a network reaches the LLM endpoint.

The sandbox keeps its own network namespace (bwrap --unshare-net: only ``lo``). The run
daemon's per-job endpoint listens on a Unix socket in the per-sandbox directory, which is
bind-mounted into the sandbox; the ``relay`` tool listens on ``127.0.0.1:<port>`` inside the
sandbox's namespace and copies bytes both ways between each accepted TCP connection and a
fresh connection to that Unix socket. An unmodified program pointed at
``OPENAI_BASE_URL=http://127.0.0.1:<port>/v1`` thus talks HTTP to the endpoint; the relay
never parses HTTP. When the agent goes away (killed, cancelled) its TCP connection closes
and the relay closes the Unix side, so the endpoint sees the disconnect.

Also usable on the host (stdlib only): ``Relay(unix_path).start()`` gives a ``127.0.0.1``
port for an agent running outside any sandbox.
"""
from __future__ import annotations

import errno
import os
import select
import socket
import threading
import time
from typing import Any, Callable, Dict, Optional, Tuple

from .cancel import Canceller
from .errors import ArgError, ToolError

_CHUNK = 256 * 1024
SIOCGIFFLAGS, SIOCSIFFLAGS, IFF_UP = 0x8913, 0x8914, 0x1


def ensure_loopback() -> bool:
    """Bring ``lo`` up if it is down (a fresh network namespace); True if we had to.

    bwrap already does this for --unshare-net; other runtimes (a bare ``unshare -n``) may not.
    """
    probe = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    try:
        probe.bind(("127.0.0.1", 0))
        return False
    except OSError as e:
        if e.errno != errno.EADDRNOTAVAIL:
            raise
    finally:
        probe.close()
    import fcntl
    import struct

    s = socket.socket(socket.AF_INET, socket.SOCK_DGRAM)
    try:
        ifr = struct.pack("16sH14x", b"lo", 0)
        flags = struct.unpack("16sH14x", fcntl.ioctl(s, SIOCGIFFLAGS, ifr))[1]
        fcntl.ioctl(s, SIOCSIFFLAGS, struct.pack("16sH14x", b"lo", flags | IFF_UP))
    except OSError as e:
        raise ToolError("the loopback interface is down and cannot be brought up: %s" % e) from None
    finally:
        s.close()
    return True


MAX_OPEN = 128  # connections relayed at once; the endpoint itself serves 64 per job


class Relay:
    """Listen on ``host:port`` (0: any free port) and relay each connection to ``unix_path``.

    At most ``max_open`` connections are relayed at once (two threads each, in the tool server,
    which no RLIMIT_NPROC bounds): a connection past that is reset at once, so an agent opening
    thousands of connections costs the node nothing but the resets (it once made 11,000 threads).
    """

    def __init__(self, unix_path: str, host: str = "127.0.0.1", port: int = 0, backlog: int = 256,
                 max_open: int = MAX_OPEN) -> None:
        self.unix_path = unix_path
        self.host = host
        self.want_port = port
        self.backlog = backlog
        self.port: Optional[int] = None
        self.connections = 0  # accepted so far
        self.refused = 0  # reset because max_open were being relayed
        self._slots = threading.BoundedSemaphore(max_open)
        self._sock: Optional[socket.socket] = None
        self._open: Dict[int, Tuple[socket.socket, socket.socket]] = {}
        self._lock = threading.Lock()
        self._closed = False

    def start(self) -> int:
        s = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            s.bind((self.host, self.want_port))
            s.listen(self.backlog)
        except OSError:
            s.close()
            raise
        self._sock = s
        self.port = s.getsockname()[1]
        threading.Thread(target=self._accept_loop, name="relay-accept", daemon=True).start()
        return self.port

    def _accept_loop(self) -> None:
        sock = self._sock
        while not self._closed:
            try:
                conn, _ = sock.accept()
            except InterruptedError:
                continue
            except OSError:
                return  # closed by stop()
            self.connections += 1
            if not self._slots.acquire(blocking=False):
                self.refused += 1
                _abort(conn)
                continue
            try:
                threading.Thread(target=self._serve, args=(conn,), name="relay-conn", daemon=True).start()
            except RuntimeError:  # no thread to be had: refuse this one, keep relaying the others
                self._slots.release()
                self.refused += 1
                _abort(conn)

    def _serve(self, tcp: socket.socket) -> None:
        try:
            self._relay(tcp)
        finally:
            self._slots.release()

    def _relay(self, tcp: socket.socket) -> None:
        up = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            up.settimeout(10.0)
            up.connect(self.unix_path)
            up.settimeout(None)
        except OSError:
            # Nothing listens: close the client's connection at once (it sees a reset, not a hang).
            up.close()
            _abort(tcp)
            return
        tcp.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        key = tcp.fileno()
        with self._lock:
            if self._closed:
                up.close()
                _abort(tcp)
                return
            self._open[key] = (tcp, up)
        back = threading.Thread(target=_pump, args=(up, tcp), name="relay-down", daemon=True)
        back.start()
        _pump(tcp, up)
        back.join()
        with self._lock:
            self._open.pop(key, None)
        tcp.close()
        up.close()

    def stop(self) -> None:
        """Stop listening and cut every open connection."""
        with self._lock:
            self._closed = True
            pairs = list(self._open.values())
        if self._sock is not None:
            try:
                self._sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
            self._sock.close()
        for a, b in pairs:
            for s in (a, b):
                try:
                    s.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass

    def info(self) -> Dict[str, Any]:
        with self._lock:
            n = len(self._open)
        return {"socket": self.unix_path, "host": self.host, "port": self.port, "open": n,
                "accepted": self.connections, "refused": self.refused}


def _abort(s: socket.socket) -> None:
    try:  # RST instead of FIN: the client fails fast instead of waiting for a reply
        s.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\x01\x00\x00\x00\x00\x00\x00\x00")
    except OSError:
        pass
    s.close()


_DRAIN_S = 30.0  # how long an upload the far side stopped reading is still dropped


def _drain(src: socket.socket) -> None:
    """Read and drop what ``src`` still sends (bounded in time): the far side has stopped reading
    (it answered early, e.g. 413, and closed), and its answer, pumped the other way, must reach
    the client, which is still sending and reads only afterwards."""
    end = time.monotonic() + _DRAIN_S
    try:
        while time.monotonic() < end:
            r, _, _ = select.select([src], [], [], max(0.0, end - time.monotonic()))
            if not r or not src.recv(_CHUNK):
                return
    except (OSError, ValueError):
        return


def _pump(src: socket.socket, dst: socket.socket) -> None:
    """Copy src -> dst until EOF or an error; then half-close dst (or cut both on an error).

    A failed write to ``dst`` does not cut the other direction: the far side may have answered
    before reading everything (a 413 from Content-Length) and that answer is still on its way."""
    try:
        while True:
            data = src.recv(_CHUNK)
            if not data:
                break
            try:
                dst.sendall(data)
            except OSError:
                _drain(src)
                return
    except OSError:
        for s in (src, dst):
            try:
                s.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        return
    try:
        dst.shutdown(socket.SHUT_WR)
    except OSError:
        pass


def tools(server: Any) -> Dict[str, Callable[[Dict[str, Any], Canceller], Dict[str, Any]]]:
    """The ``relay`` tool: ``{"socket": PATH, "port": 0}`` starts a relay (or returns the one
    already relaying PATH) and answers its port in ``info``; ``{"stop": PATH}`` stops it."""
    relays: Dict[str, Relay] = {}
    lock = threading.Lock()

    def t_relay(args: Dict[str, Any], canceller: Canceller) -> Dict[str, Any]:
        stop = args.get("stop")
        if stop is not None:
            if not isinstance(stop, str):
                raise ArgError("'stop' must be the Unix socket path of a running relay")
            with lock:
                r = relays.pop(stop, None)
            if r is None:
                raise ToolError("no relay to %s is running" % stop)
            r.stop()
            return {"output": "stopped", "exit_code": 0, "error": None, "duration": 0.0, "timed_out": False,
                    "truncated": False, "info": r.info()}
        path = args.get("socket")
        if not isinstance(path, str) or not os.path.isabs(path):
            raise ArgError("'socket' (the absolute path of the Unix socket to relay to) is required")
        port = args.get("port", 0)
        if isinstance(port, bool) or not isinstance(port, int) or not 0 <= port <= 65535:
            raise ArgError("'port' must be an integer in 0..65535 (0: any free port)")
        with lock:
            r = relays.get(path)
            if r is None:
                ensure_loopback()
                r = Relay(path, "127.0.0.1", port)
                try:
                    r.start()
                except OSError as e:
                    raise ToolError("cannot listen on 127.0.0.1:%d: %s" % (port, e.strerror or e)) from None
                relays[path] = r
        return {"output": "http://127.0.0.1:%d" % r.port, "exit_code": 0, "error": None, "duration": 0.0,
                "timed_out": False, "truncated": False, "info": r.info()}

    return {"relay": t_relay}

