"""bus.sockets.send_nowait / recv_now move a message frame by frame (not through pyzmq's
*_multipart): a message arrives whole and in order, on plain and zmq.asyncio sockets, through
ROUTER envelopes; a message holding something that is not a buffer is refused before any of
it is sent (half a message queued would be glued to the next one)."""
from __future__ import annotations

import asyncio

import numpy as np
import pytest

from rolloutd.bus.sockets import Sockets, recv_now, send_nowait


def _drain(sock, n, tries=2000):
    import time

    got = []
    for _ in range(tries):
        m = recv_now(sock)
        if m is not None:
            got.append([bytes(f.bytes) for f in m])
            if len(got) == n:
                return got
        else:
            time.sleep(0.001)
    return got


@pytest.mark.parametrize("use_asyncio", [False, True])
def test_messages_arrive_whole_and_a_bad_frame_sends_nothing(use_asyncio):
    async def main():
        s = Sockets(asyncio=use_asyncio, linger_ms=0)
        try:
            rx = s.bind("PULL", "inproc://frames")
            tx = s.connect("PUSH", "inproc://frames")
            arr = np.arange(4, dtype=np.int32)
            msgs = [[b"one"], [b"a", memoryview(b"bb"), b"", arr], [b"x" * 70000, b"tail"]]
            for m in msgs:
                send_nowait(tx, m)
            with pytest.raises(TypeError):
                send_nowait(tx, [b"head", object(), b"never"])
            send_nowait(tx, [b"after"])
            got = _drain(rx, 4)
            assert got == [[b"one"], [b"a", b"bb", b"", arr.tobytes()], [b"x" * 70000, b"tail"], [b"after"]]
            assert recv_now(rx) is None
        finally:
            s.close()

    asyncio.run(main())


def test_a_router_reply_reaches_its_dealer_with_every_frame():
    s = Sockets(asyncio=False, linger_ms=0)
    try:
        router = s.bind("ROUTER", "inproc://env")
        dealer = s.connect("DEALER", "inproc://env", identity=b"peer-1")
        send_nowait(dealer, [b"hello", b"2"])
        ident, *body = _drain(router, 1)[0]
        assert ident == b"peer-1" and body == [b"hello", b"2"]
        send_nowait(router, [ident, b"", b"reply", b"more"])
        assert _drain(dealer, 1) == [[b"", b"reply", b"more"]]
    finally:
        s.close()
