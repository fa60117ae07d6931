"""Length-prefixed JSON frames over a stream socket (the client <-> tool server wire).

A frame is a 4-byte big-endian unsigned length followed by that many bytes of UTF-8
JSON (one object). Stdlib only: the same module is used by the host client.
"""
from __future__ import annotations

import json
import socket
import struct
from typing import Any, Dict, Optional

HEADER = struct.Struct("!I")
# A tool output is capped well below this; the limit only guards against garbage input.
MAX_FRAME = 64 * 1024 * 1024


class FrameError(Exception):
    """The peer sent something that is not a valid frame."""


def encode(obj: Dict[str, Any]) -> bytes:
    body = json.dumps(obj, ensure_ascii=False, separators=(",", ":")).encode("utf-8")
    if len(body) > MAX_FRAME:
        raise FrameError("frame of %d bytes exceeds the %d byte limit" % (len(body), MAX_FRAME))
    return HEADER.pack(len(body)) + body


def decode_body(body: bytes) -> Dict[str, Any]:
    try:
        obj = json.loads(body.decode("utf-8"))
    except (UnicodeDecodeError, ValueError) as e:
        raise FrameError("frame is not valid UTF-8 JSON: %s" % e) from None
    if not isinstance(obj, dict):
        raise FrameError("frame must hold a JSON object, got %s" % type(obj).__name__)
    return obj


def check_length(n: int) -> int:
    if n > MAX_FRAME:
        raise FrameError("announced frame of %d bytes exceeds the %d byte limit" % (n, MAX_FRAME))
    return n


def _recv_exact(sock: socket.socket, n: int) -> Optional[bytes]:
    buf = bytearray()
    while len(buf) < n:
        chunk = sock.recv(min(n - len(buf), 1 << 20))
        if not chunk:
            if not buf:
                return None
            raise FrameError("connection closed in the middle of a frame")
        buf += chunk
    return bytes(buf)


def recv_frame(sock: socket.socket) -> Optional[Dict[str, Any]]:
    """Read one frame; None on a clean EOF before a frame starts. Honors sock's timeout."""
    head = _recv_exact(sock, HEADER.size)
    if head is None:
        return None
    (n,) = HEADER.unpack(head)
    body = _recv_exact(sock, check_length(n))
    if body is None:
        raise FrameError("connection closed after a frame header")
    return decode_body(body)


def send_frame(sock: socket.socket, obj: Dict[str, Any]) -> None:
    sock.sendall(encode(obj))
