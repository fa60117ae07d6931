"""bus.sockets.InWaiter, the one await of the gateway's and the router's loops: it must wake for
a message on any socket, time out when none comes, and never steal the wake-up of a zmq.asyncio
Future that waits on one of its sockets (its EVENTS reads consume the fd's edge)."""
from __future__ import annotations

import asyncio
import time

from rolloutd.bus.sockets import InWaiter, Sockets, recv_now


def _pair(s, name):
    rx = s.bind("PULL", f"inproc://{name}")
    tx = s.connect("PUSH", f"inproc://{name}")
    return rx, tx


def test_wakes_for_a_message_on_any_socket_and_times_out_without_one():
    async def main():
        s = Sockets(asyncio=True, linger_ms=0)
        try:
            (a, ta), (b, tb) = _pair(s, "a"), _pair(s, "b")
            w = InWaiter((a, b))
            t0 = time.monotonic()
            await w.wait(300)  # nothing queued: the whole timeout (blocking part + Futures part)
            assert 0.25 <= time.monotonic() - t0 < 2.0
            assert not w.ready()

            await tb.send(b"x")
            t0 = time.monotonic()
            await w.wait(5000)
            assert time.monotonic() - t0 < 1.0 and w.ready()
            assert recv_now(b)[0].bytes == b"x" and recv_now(a) is None

            async def later(sock, delay):  # arrives after the blocking window: the Futures wake it
                await asyncio.sleep(delay)
                await sock.send(b"y")

            for delay in (0.0005, 0.05):
                task = asyncio.create_task(later(ta, delay))
                t0 = time.monotonic()
                while not w.ready():
                    await w.wait(5000)
                assert time.monotonic() - t0 < 1.0, f"woke {time.monotonic() - t0:.2f} s after a message sent at {delay}"
                assert recv_now(a)[0].bytes == b"y"
                await task
        finally:
            s.close()

    asyncio.run(main())


def test_a_future_waiting_on_one_of_its_sockets_still_wakes(tmp_path):
    """Another task awaits ``recv`` on a socket the waiter asks too. A message that lands while
    the loop is busy is seen first by the waiter's EVENTS read, which consumes the fd's edge:
    unless the waiter re-arms that Future, it sleeps until its timeout."""
    import threading

    import zmq

    addr = f"ipc://{tmp_path}/a"

    async def main():
        s = Sockets(asyncio=True, linger_ms=0)
        ctx = zmq.Context()
        tx = ctx.socket(zmq.PUSH)
        try:
            a = s.bind("PULL", addr)
            tx.connect(addr)
            w = InWaiter((a,))
            got = asyncio.ensure_future(a.recv())
            await asyncio.sleep(0.05)  # the Future is armed (its fd watched by the loop)
            sender = threading.Timer(0.1, lambda: tx.send(b"z"))
            sender.start()
            deadline = time.monotonic() + 3.0
            while not got.done() and time.monotonic() < deadline:
                time.sleep(0.005)  # the loop busy, as the gateway's is under load: the message lands now
                w.ready()          # and the waiter reads EVENTS before the loop's next select
                await asyncio.sleep(0)
            sender.join()
            assert got.done(), "the recv Future never woke: the waiter consumed its edge"
            assert got.result() == b"z"
        finally:
            tx.close(0)
            ctx.term()
            s.close()

    asyncio.run(main())


def test_send_now_behind_a_waiting_send_future_says_full_and_keeps_the_order():
    """A phase daemon sends results with send_now and awaits a Future only when the pipe is full.
    While that Future waits, a send_now must not overtake it (nor raise: it used to call
    .result() on the pending Future, InvalidStateError); it says False and the caller waits in
    line. Every message then arrives, in order."""
    from rolloutd.bus.sockets import send_now

    async def main():
        s = Sockets(asyncio=True, linger_ms=0)
        try:
            rx = s.bind("PULL", "inproc://full", hwm=1)
            tx = s.connect("PUSH", "inproc://full", hwm=1)
            sent = 0
            while send_now(tx, [b"%d" % sent]):  # fill both pipes
                sent += 1
            assert 1 <= sent < 100
            waiting = asyncio.ensure_future(tx.send_multipart([b"%d" % sent]))
            await asyncio.sleep(0.01)
            assert not waiting.done()
            assert send_now(tx, [b"%d" % (sent + 1)]) is False  # behind the Future: full, not an error
            late = asyncio.ensure_future(tx.send_multipart([b"%d" % (sent + 1)]))
            got = []
            for _ in range(sent + 2):
                got.append(int((await asyncio.wait_for(rx.recv_multipart(), 5))[0]))
            await asyncio.wait_for(asyncio.gather(waiting, late), 5)
            assert got == list(range(sent + 2)), got
        finally:
            s.close()

    asyncio.run(main())
