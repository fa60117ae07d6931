"""A test handler whose run phase keeps tool calls running in its sandbox and more queued behind
them (a bash call and a Python call each running ``sleep 1000``; two bash calls and one Python
call waiting for their tool), through the run daemon's own tool clients. Every process a call
starts carries ``ROLLOUTD_TEST_DEMO_TAG=<tag>-<which>`` in its environment, so the host can find it.

Instance: ``{"mode": "hold" | "abandon" | "echo", "tag": str, "command": str, "expect": str}``.

* ``hold``: the running bash call also leaves a background and a ``setsid`` process; once ping
  shows the three calls waiting, the handler writes ``all_queued`` into the workspace (host side)
  and awaits every call: the job only ends by its cancel or its timeout.
* ``abandon``: the queued calls' clients go away (two tasks cancelled, one client past its own
  deadline), then the running calls' tasks are cancelled, and the job goes on in the same sandbox:
  a Python call and a bash call that lists what is left (``LEFT`` lines for tagged processes,
  ``ghost-*`` files a queued call would have made) must answer exactly; reward 1 if so.
* ``echo``: one bash call; reward 1 if its output is ``expect``.
"""
from __future__ import annotations

import asyncio
import time
from pathlib import Path

from rolloutd.handlers.base import AgentHandler

TAG = "ROLLOUTD_TEST_DEMO_TAG"
PY = "import subprocess\nopen('/workspace/{started}', 'w').close()\nsubprocess.run(['env', '{tag_var}={tag}', 'sleep', '1000'])\n"
# (the tool server, pid 1, is not dumpable: its environ is unreadable, said on stderr first)
CHECK = ("for d in /proc/[0-9]*; do tr '\\0' '\\n' 2>/dev/null < $d/environ | grep -q '^{tag_var}={tag}' "
         "&& echo \"LEFT $(tr '\\0' ' ' < $d/cmdline)\"; done; ls /workspace | grep ghost; echo checked")
NO_WAITING = {"bash": 0, "python": 0, "editor": 0}


def running_bash(tag: str, leave_background: bool) -> str:
    bg = (f"setsid env {TAG}={tag}-setsid sleep 1000 >/dev/null 2>&1 & "
          f"env {TAG}={tag}-bg sleep 1000 >/dev/null 2>&1 & " if leave_background else "")
    return bg + f"touch /workspace/bash_started; env {TAG}={tag}-run sleep 1000"


def queued_bash(tag: str, i: int) -> str:
    return f"touch /workspace/ghost-{i}; env {TAG}={tag}-q{i} sleep 1000"


async def _until(what: str, pred, watch=(), timeout_s: float = 120.0):
    """Poll ``pred`` (a bound, not a speed); a watched call that ends first is the failure."""
    end = time.monotonic() + timeout_s
    while True:
        got = await pred()
        if got:
            return got
        for t in watch:
            if t.done():
                raise RuntimeError(f"a call ended while waiting for {what}: {t.result() if not t.exception() else t.exception()!r}")
        if time.monotonic() > end:
            raise TimeoutError(f"waiting for {what}: last {got!r}")
        await asyncio.sleep(0.05)


class ToolQueue(AgentHandler):
    name = "tool_queue"
    needs_sandbox = True

    async def init(self, ctx):
        from rolloutd.sandbox import Limits, SandboxSpec

        spec = SandboxSpec(limits=Limits(nproc=64, cpu_seconds=600, wall_seconds=900))
        await asyncio.to_thread(ctx.create_sandbox, spec)

    async def run(self, ctx):
        mode = ctx.instance["mode"]
        if mode == "echo":
            async with ctx.tools() as t:
                r = await t.call("bash", {"command": ctx.instance["command"], "timeout": 30})
            ctx.state.update(output=r.output, exit_code=r.exit_code)
            return
        from rolloutd.sandbox import AsyncToolClient

        tag, ws = ctx.instance["tag"], Path(ctx.sandbox["workspace"])
        t, probe = ctx.tools(), ctx.tools()
        deadline_client = AsyncToolClient(ctx.sandbox["tool_socket"], grace=0.2)

        async def info(pred):
            i = (await probe.ping()).info
            return i if pred(i) else None

        try:
            running = [
                asyncio.create_task(t.call("bash", {"command": running_bash(tag, mode == "hold"), "timeout": 1000})),
                asyncio.create_task(t.call("python", {"code": PY.format(started="py_started", tag_var=TAG, tag=f"{tag}-py"),
                                                      "timeout": 1000})),
            ]

            async def started():
                return (ws / "bash_started").exists() and (ws / "py_started").exists()

            await _until("both running calls to start", started, running)
            queued = [asyncio.create_task(t.call("bash", {"command": queued_bash(tag, 1), "timeout": 1000})),
                      asyncio.create_task(t.call("python", {"code": PY.format(started="ghost-py", tag_var=TAG, tag=f"{tag}-qpy"),
                                                            "timeout": 1000}))]
            if mode == "hold":
                queued.append(asyncio.create_task(t.call("bash", {"command": queued_bash(tag, 2), "timeout": 1000})))
                await _until("three calls waiting", lambda: info(lambda i: i["waiting"] == {"bash": 2, "python": 1, "editor": 0}),
                             running + queued)
                (ws / "all_queued").write_text("")
                await asyncio.gather(*running, *queued)  # ends only by the job's cancel or timeout
                return
            await _until("two calls waiting", lambda: info(lambda i: i["waiting"] == {"bash": 1, "python": 1, "editor": 0}),
                         running + queued)
            # A third, whose client leaves at its own deadline (1 s + 0.2 s grace) while it waits.
            late = await asyncio.gather(deadline_client.call("bash", {"command": queued_bash(tag, 2), "timeout": 1000},
                                                             timeout=1.0), return_exceptions=True)
            for q in queued:
                q.cancel()
            outcomes = late + list(await asyncio.gather(*queued, return_exceptions=True))
            dropped = await _until("the queued calls dropped",  # the server sees each client leave within 50 ms
                                   lambda: info(lambda i: i["abandoned"] == 3 and i["waiting"] == NO_WAITING),
                                   timeout_s=30)
            for r in running:
                r.cancel()
            outcomes += await asyncio.gather(*running, return_exceptions=True)
            # The same sandbox goes on: each tool answers, nothing of those calls is left or ran.
            py = await t.call("python", {"code": "print('python ok')", "timeout": 30})
            check = await t.call("bash", {"command": CHECK.format(tag_var=TAG, tag=tag), "timeout": 30})
            after = (await probe.ping()).info
        finally:
            for c in (t, probe, deadline_client):
                await c.close()
        ctx.state.update(outcomes=[type(o).__name__ for o in outcomes], python=py.output, check=check.output,
                         abandoned=dropped["abandoned"], abandoned_after=after["abandoned"], waiting_after=after["waiting"])

    async def eval(self, ctx):
        s = ctx.state
        if ctx.instance["mode"] == "echo":
            ok = s.get("exit_code") == 0 and s.get("output") == ctx.instance.get("expect")
            ctx.set_reward(1.0 if ok else 0.0, output=s.get("output", "")[-500:], exit_code=s.get("exit_code"))
            return
        ok = (s["python"] == "python ok\n" and s["check"] == "checked\n" and s["abandoned"] == s["abandoned_after"] == 3
              and s["waiting_after"] == NO_WAITING)
        ctx.set_reward(1.0 if ok else 0.0, **{k: s[k] for k in ("outcomes", "python", "check", "abandoned",
                                                                 "abandoned_after", "waiting_after")})
