"""A tiny real HTTP server for the wire-shape tests: a raw ASGI app on uvicorn (127.0.0.1, port 0)
that hands each request to a test's handler, which parses it with a wire module and answers with
that module's rendering of a canned :class:`Reply`. No endpoint session: translation only."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolloutd.llm.openai_endpoint import serve
from rolloutd.llm.openai_wire import EndpointError, Reply, bad, chat_response, parse_messages


@dataclass
class Seen:
    method: str
    path: str
    query: str
    headers: dict
    body: Any


@dataclass
class Answer:
    status: int
    chunks: list[bytes]
    sse: bool = False
    headers: list = field(default_factory=list)


Handler = Callable[[Seen], Answer]


def make_app(handler: Handler, error_body: Callable[[EndpointError], bytes], seen: list[Seen]):
    async def app(scope, receive, send):
        if scope["type"] != "http":
            return
        raw = b""
        while True:
            msg = await receive()
            raw += msg.get("body", b"")
            if not msg.get("more_body"):
                break
        try:
            try:
                body = json.loads(raw) if raw else None
            except ValueError as e:
                raise bad(f"the body is not valid JSON: {e}") from None
            s = Seen(scope["method"], scope["path"], scope.get("query_string", b"").decode(),
                     {k.decode(): v.decode() for k, v in scope["headers"]}, body)
            seen.append(s)
            ans = handler(s)
        except EndpointError as e:
            ans = Answer(e.status, [error_body(e)])
        ctype = b"text/event-stream" if ans.sse else b"application/json"
        await send({"type": "http.response.start", "status": ans.status,
                    "headers": [(b"content-type", ctype)] + ans.headers})
        for c in ans.chunks:
            await send({"type": "http.response.body", "body": c, "more_body": True})
        await send({"type": "http.response.body", "body": b""})

    return app


class WireServer:
    """``async with WireServer(handler, error_body) as srv``: ``srv.url``, ``srv.seen``."""

    def __init__(self, handler: Handler, error_body: Callable[[EndpointError], bytes]) -> None:
        self.seen: list[Seen] = []
        self.app = make_app(handler, error_body, self.seen)

    async def __aenter__(self) -> WireServer:
        self.server = await serve(self.app, host="127.0.0.1", port=0)
        self.url = f"http://127.0.0.1:{self.server.port}"
        return self

    async def __aexit__(self, *exc) -> None:
        await self.server.stop()


def reply(content: str | None = "Done.", calls: list[tuple[str, dict]] = (), reasoning: str | None = None,
          finish: str = "stop", stop_sequence: str | None = None, rid: str = "chatcmpl-0123abcd") -> Reply:
    """A canned reply as the endpoint builds it (tool calls with ids and JSON-string arguments)."""
    tcs = [{"id": f"call_7_{k}", "type": "function",
            "function": {"name": n, "arguments": json.dumps(a, ensure_ascii=False)}} for k, (n, a) in enumerate(calls)]
    if tcs and finish == "stop":
        finish = "tool_calls"
    return Reply(id=rid, model="rolloutd", content=content, tool_calls=tcs, reasoning=reasoning,
                 finish_reason=finish, prompt_tokens=123, completion_tokens=45, token_ids=list(range(45)),
                 logprobs=[-0.5] * 45, stop_sequence=stop_sequence)


def chat_msg(r: Reply):
    """The Msg the Chat Completions path parses when an agent sends ``r`` back unchanged: the
    reference every shape's round trip must reproduce (as values, call ids aside)."""
    m = dict(chat_response(r)["choices"][0]["message"])
    return parse_messages([{"role": "user", "content": "x"}, m])[1]


def same_turn(a, b) -> bool:
    """Two assistant Msgs the endpoint treats as the same turn: role, content (stripped), calls."""
    return (a.role, a.content.strip(), a.calls) == (b.role, b.content.strip(), b.calls)
