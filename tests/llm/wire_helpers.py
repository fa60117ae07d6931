"""A tiny real HTTP server for the wire-shape tests: a raw ASGI app on uvicorn (127.0.0.1, port 0)
that hands each request to a test's handler, which parses it with a wire module and answers with
that module's rendering of a canned :class:`Reply`. No endpoint session: translation only."""

from __future__ import annotations

import json
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from rolloutd.endpoint.server import serve
from rolloutd.endpoint.shapes.chat import chat_response, parse_messages
from rolloutd.endpoint.wire import EndpointError, Reply, bad

from .uvicorn_server import read_body


def need_sdk(module: str, what: str):
    """Import a real SDK the test parses with: skip where it is missing, fail under
    ROLLOUTD_TEST_STRICT=1 (CI installs the harness extra, which has it)."""
    import importlib
    import os

    import pytest

    try:
        return importlib.import_module(module)
    except ImportError:
        msg = f"{what} is not installed (pip install 'rolloutd[harness]')"
        if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":
            pytest.fail("ROLLOUTD_TEST_STRICT=1: " + msg, pytrace=False)
        pytest.skip(msg, allow_module_level=True)


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
        raw = await read_body(receive) or b""
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


async def post_bad_bodies(srv: WireServer, bad: list, path: str, raw: bytes,
                          raw_path: str | None = None) -> list[tuple[str, str, int, Any]]:
    """POST each ``(name, body, needle)`` of ``bad`` to ``path``, then ``raw`` (bytes that are not
    JSON) to ``raw_path`` (default ``path``): ``(name, needle, status, reply JSON)`` per request."""
    import httpx

    out = []
    async with httpx.AsyncClient(timeout=30) as h:
        for name, body, needle in bad:
            resp = await h.post(srv.url + path, content=json.dumps(body))
            out.append((name, needle, resp.status_code, resp.json()))
        resp = await h.post(srv.url + (raw_path or path), content=raw)
        out.append(("not json", "JSON", resp.status_code, resp.json()))
    return out


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


_ODD = [None, 0, -1, 1.5, True, "", "x", [], [None], {}, {"type": None}, {"type": "text"}, [{"type": "zzz"}],
        "\udc80", 10 ** 30, float("nan")]


def _paths(v, path=()):
    yield path
    if isinstance(v, dict):
        for k, x in v.items():
            yield from _paths(x, path + (k,))
    elif isinstance(v, list):
        for i, x in enumerate(v):
            yield from _paths(x, path + (i,))


def mutations(body: dict, n: int, seed: int = 0):
    """``n`` copies of ``body``, each with one node replaced by an odd JSON value or deleted (seeded)."""
    import copy
    import random

    rng = random.Random(seed)
    paths = [p for p in _paths(body) if p]
    for _ in range(n):
        b = copy.deepcopy(body)
        p = rng.choice(paths)
        parent = b
        for k in p[:-1]:
            parent = parent[k]
        if isinstance(parent, dict) and rng.random() < 0.25:
            del parent[p[-1]]
        else:
            parent[p[-1]] = copy.deepcopy(rng.choice(_ODD))
        yield p, b


def fuzz(parse, render, body: dict, n: int = 400, cached=None) -> int:
    """Every mutation of ``body`` is either parsed (and its reply rendered) or refused with a 400
    EndpointError: never another exception. ``cached(body, cache)``: the same parse with a
    history cache, which, primed with ``body``, must give exactly what ``parse`` gives (or the same
    refusal). Returns how many were refused."""
    refused = 0
    for p, b in mutations(body, n):
        if cached is not None:
            cache: dict = {}
            cached(body, cache)
            try:
                via_cache = cached(b, cache)
            except EndpointError as e:
                via_cache = ("refused", e.status, e.message)
            except Exception:  # noqa: BLE001 - reported below, from the uncached parse
                via_cache = None
        try:
            req = parse(b)
        except EndpointError as e:
            assert e.status == 400 and e.message, p
            assert cached is None or via_cache == ("refused", e.status, e.message), p
            refused += 1
            continue
        except Exception as e:  # noqa: BLE001 - the point: a crash here would be a 500
            raise AssertionError(f"mutation at {p} raised {type(e).__name__}: {e}") from e
        assert cached is None or via_cache == req, (p, via_cache, req)
        try:
            render(req)
        except Exception as e:  # noqa: BLE001
            raise AssertionError(f"rendering after the mutation at {p} raised {type(e).__name__}: {e}") from e
    return refused
