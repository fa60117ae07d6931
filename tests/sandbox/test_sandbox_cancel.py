"""Cancelling a call (task.cancel() on AsyncToolClient, or a client deadline) interrupts
the command inside the sandbox."""
import asyncio
import time

import pytest

from rolloutd.sandbox import AsyncToolClient, ToolClient, ToolTransportError

COUNT_SLEEPS = "n=0; for p in /proc/[0-9]*; do [ \"$(cat $p/comm 2>/dev/null)\" = sleep ] && n=$((n+1)); done; echo $n"


def test_async_cancel_interrupts_bash(tool_env):
    _, h, c = tool_env
    c.call("bash", {"command": "rm -f /workspace/cancel_mark"})

    async def main():
        ac = AsyncToolClient(h.tool_socket, timeout=30)
        try:
            task = asyncio.ensure_future(ac.call("bash", {
                "command": "echo start > /workspace/cancel_mark; sleep 30; echo done >> /workspace/cancel_mark",
                "timeout": 30}))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            t0 = time.monotonic()
            r = await ac.call("bash", {"command": "echo after", "timeout": 10})
            return r, time.monotonic() - t0
        finally:
            await ac.close()

    r, waited = asyncio.run(main())
    assert r.output == "after\n"
    assert waited < 8  # the shell was freed by the interrupt, not by the 30 s sleep ending
    assert c.call("bash", {"command": "cat /workspace/cancel_mark"}).output == "start\n"
    assert c.call("bash", {"command": COUNT_SLEEPS}).output == "0\n"


def test_async_cancel_interrupts_python(tool_env):
    _, h, c = tool_env
    c.call("python", {"code": "marker = 'kept'"})

    async def main():
        ac = AsyncToolClient(h.tool_socket)
        try:
            task = asyncio.ensure_future(ac.call("python", {"code": "import time\nwhile True: time.sleep(0.01)", "timeout": 30}))
            await asyncio.sleep(0.5)
            task.cancel()
            with pytest.raises(asyncio.CancelledError):
                await task
            return await asyncio.wait_for(ac.call("python", {"code": "marker"}), 5)
        finally:
            await ac.close()

    assert asyncio.run(main()).output == "'kept'\n"


def test_many_concurrent_async_calls_on_one_client(tool_env):
    _, h, _ = tool_env

    async def main():
        ac = AsyncToolClient(h.tool_socket)
        try:
            pings = await asyncio.gather(*[ac.ping() for _ in range(20)])
            r = await ac.call("bash", {"command": "echo x"})
            return pings, r
        finally:
            await ac.close()

    pings, r = asyncio.run(main())
    assert all(p.output == "pong" for p in pings) and r.output == "x\n"


def test_sync_client_deadline_raises_and_interrupts(tool_env):
    _, h, c = tool_env
    with ToolClient(h.tool_socket, grace=0.2) as tc:
        t0 = time.monotonic()
        with pytest.raises(ToolTransportError, match="did not answer"):
            tc.call("bash", {"command": "sleep 30", "timeout": 30}, timeout=0.5)
        assert time.monotonic() - t0 < 5
    r = c.call("bash", {"command": "echo free", "timeout": 10})
    assert r.output == "free\n" and r.duration < 8
    assert c.call("bash", {"command": COUNT_SLEEPS}).output == "0\n"


def test_unreachable_socket_is_a_transport_error(tmp_path):
    with pytest.raises(ToolTransportError, match="not reachable"):
        ToolClient(str(tmp_path / "nope.sock")).ping()

    async def main():
        with pytest.raises(ToolTransportError):
            await AsyncToolClient(str(tmp_path / "nope.sock")).ping()

    asyncio.run(main())
