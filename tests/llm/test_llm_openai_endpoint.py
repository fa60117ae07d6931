"""The OpenAI-compatible per-job endpoint, end to end: the real ``openai`` SDK as the agent's
client, a real uvicorn socket, the real Qwen2.5 tokenizer and chat template, and the scripted
backend speaking vLLM's HTTP API. Every backend reply is observed where the run daemon would
see it (the ``generate`` callable) and compared with the trajectory, id for id."""

from __future__ import annotations

import asyncio
import importlib
import json
import re
import time

import numpy as np
import pytest

openai = pytest.importorskip("openai", reason="the openai SDK is not installed (pip install rolloutd[harness])")
pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[daemon])")

from rolloutd.llm.client import LLMClient, simple_generate
from rolloutd.endpoint.app import make_app
from rolloutd.endpoint.bounds import EndpointLimits
from rolloutd.endpoint.server import serve
from rolloutd.endpoint.session import EndpointSession
from rolloutd.backends.policies import Policy, PolicyReply

from .conftest import BASH_TOOL

# The HTTP library the installed openai SDK is built on (httpx, or httpx2 in openai 3.x): a custom
# http_client (a Unix-socket transport) must be one of its clients.
httpx_lib = importlib.import_module(openai.DefaultAsyncHttpxClient.__mro__[1].__module__.split(".")[0])

pytestmark = pytest.mark.timeout(300)  # the first test also builds the Qwen2.5 tokenizer (slow on a busy box)

TOOLS = [BASH_TOOL]
_TAGS = re.compile(r"(<tool_call>|</tool_call>)")


def odd_split(tok, text: str) -> list[int]:
    """Ids for ``text`` that the BPE would never produce (one token per character; the tool-call
    tags stay the single added tokens a Qwen model emits)."""
    ids: list[int] = []
    for piece in _TAGS.split(text):
        if _TAGS.fullmatch(piece):
            ids += tok.encode(piece, add_special_tokens=False)
        else:
            ids += [t for ch in piece for t in tok.encode(ch, add_special_tokens=False)]
    return ids


class Script(Policy):
    """Reply k comes from a list (by request order), as odd token splits; records the prompts."""

    def __init__(self, tok, replies, split=True):
        super().__init__()
        self.tok, self.replies, self.split = tok, replies, split
        self.prompts: list[list[int]] = []

    def reply(self, request):
        text = self.replies[min(len(self.prompts), len(self.replies) - 1)]
        self.prompts.append(list(request.prompt_ids))
        ids = odd_split(self.tok, text) if self.split else None
        if ids is not None:
            assert self.tok.decode(ids) == text
        return PolicyReply(text=text, token_ids=ids)


class Endpoint:
    """A session served over a real socket, with the backend's replies recorded as they arrive."""

    def __init__(self, tok, backend_url, limits=None, uds=None, **kw):
        self.tok, self.url, self.limits, self.uds, self.kw = tok, backend_url, limits, uds, kw
        self.seen: list[tuple[list[int], list[int], np.ndarray]] = []

    async def __aenter__(self):
        self.llm = LLMClient(self.url, timeout=60)
        inner = simple_generate(self.llm, "b0", 7)

        async def generate(ids, params):
            g, b, v = await inner(ids, params)
            self.seen.append((np.asarray(ids).tolist(), g.token_ids.tolist(), g.logprobs.copy()))
            return g, b, v

        self.session = EndpointSession(generate, self.tok, limits=self.limits or EndpointLimits(max_context=4096),
                                       **self.kw)
        if self.uds:
            self.server = await serve(make_app(self.session), uds=self.uds)
            http = httpx_lib.AsyncClient(transport=httpx_lib.AsyncHTTPTransport(uds=self.uds))
            self.client = openai.AsyncOpenAI(base_url=self.server.base_url, api_key="k", max_retries=0,
                                             http_client=http)
        else:
            self.server = await serve(make_app(self.session), host="127.0.0.1", port=0)
            self.client = openai.AsyncOpenAI(base_url=self.server.base_url, api_key="k", max_retries=0)
        return self

    async def __aexit__(self, *exc):
        await self.client.close()
        await self.server.stop()
        await self.llm.aclose()


def check_exact(tok, rec: dict, seen: list) -> None:
    """Each turn's span is the backend's ids and logprobs; the backend saw exactly the trajectory's
    prefix; everything not sampled is masked."""
    prompt, resp = rec["prompt_ids"].tolist(), rec["response_ids"].tolist()
    mask, lps = rec["loss_mask"], rec["logprobs"]
    assert len(rec["turns"]) == len(seen)
    full = prompt + resp
    for t, (sent, ids, lp) in zip(rec["turns"], seen):
        s, e = t["span"]
        assert resp[s:e] == ids
        assert np.array_equal(lps[s:e], np.asarray(lp, np.float32))
        assert mask[s:e].tolist() == [1] * len(ids)
        assert sent == full[: len(prompt) + s]  # what the backend was sent is the trajectory up to the span
        assert t["backend"] == "b0" and t["policy_version"] == 7
    assert int(mask.sum()) == sum(len(ids) for _, ids, _ in seen)
    assert not lps[mask == 0].any()
    assert rec["prompt_ids"].dtype == np.int32 and rec["loss_mask"].dtype == np.int8
    assert rec["logprobs"].dtype == np.float32


def test_text_history_keeps_the_sampled_ids(qwen_tokenizer, scripted, arun):
    """An agent that sends our replies back as plain text (mini-swe-agent's way): the assistant
    turns stay the backend's odd token splits, never a re-encoding of their text."""
    tok = qwen_tokenizer
    replies = ["Let me look.\n```bash\nls -la\n```", "Now the tests.\n```bash\npytest -q\n```", "All done."]
    be = scripted(tok, Script(tok, replies))

    async def main():
        async with Endpoint(tok, be.url) as ep:
            msgs = [{"role": "system", "content": "You are a shell agent."}, {"role": "user", "content": "fix it"}]
            outs = []
            for obs in ("a.py b.py", "1 passed", None):
                r = await ep.client.chat.completions.create(model="any", messages=msgs, temperature=0.7)
                outs.append(r)
                msgs.append({"role": "assistant", "content": r.choices[0].message.content})
                if obs:
                    msgs.append({"role": "user", "content": obs})
            return ep, outs, msgs

    ep, outs, msgs = arun(main())
    assert [o.choices[0].message.content for o in outs] == replies
    assert all(o.choices[0].finish_reason == "stop" and not o.choices[0].message.tool_calls for o in outs)
    t = ep.session.trajectory()
    assert "segments" not in t and t["metrics"]["segments"] == 1
    check_exact(tok, t, ep.seen)
    sampled = [ids for _, ids, _ in ep.seen]
    assert t["metrics"]["assistant_tokens_reused"] == sum(map(len, sampled[:2]))
    assert t["metrics"]["assistant_tokens_reencoded"] == 0
    # the splits really are non-canonical: a text round trip would have trained on other ids
    for ids, text in zip(sampled, replies):
        assert tok.encode(text, add_special_tokens=False) != ids[:-1]
    # everything that is not sampled is exactly the chat template's text
    full = t["prompt_ids"].tolist() + t["response_ids"].tolist()
    assert tok.decode(full) + "\n" == tok.apply_chat_template(msgs, tokenize=False)  # (the closing newline
    # comes with the next message)
    # usage is the context sent and the tokens sampled
    for o, (sent, ids, _) in zip(outs, ep.seen):
        assert o.usage.prompt_tokens == len(sent) and o.usage.completion_tokens == len(ids)


def test_two_structured_tool_calls_in_one_turn(qwen_tokenizer, scripted, arun):
    """The agent gets OpenAI tool_calls parsed from the sampled text and sends them back as
    structured tool_calls (the openai SDK way): the turn keeps its ids; tool results are rendered
    with the template's own delimiters and masked."""
    tok = qwen_tokenizer
    two = ('I will run two commands.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>\n'
           '<tool_call>\n{"name": "bash", "arguments": {"command": "cat a.py"}}\n</tool_call>')
    be = scripted(tok, Script(tok, [two, "The answer is 42."]))

    async def main():
        async with Endpoint(tok, be.url) as ep:
            msgs = [{"role": "user", "content": "what is in a.py?"}]
            r1 = await ep.client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, logprobs=True)
            m = r1.choices[0].message
            msgs.append(m.model_dump(exclude_none=True))  # what an SDK loop appends
            for tc, out in zip(m.tool_calls, ("a.py", "print(42)")):
                msgs.append({"role": "tool", "tool_call_id": tc.id, "content": out})
            r2 = await ep.client.chat.completions.create(model="m", messages=msgs, tools=TOOLS)
            return ep, r1, r2

    ep, r1, r2 = arun(main())
    c = r1.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "I will run two commands."
    calls = c.message.tool_calls
    assert [(x.function.name, json.loads(x.function.arguments)) for x in calls] == [
        ("bash", {"command": "ls"}), ("bash", {"command": "cat a.py"})]
    assert len({x.id for x in calls}) == 2
    # logprobs as OpenAI's shape, one per sampled token
    assert [x.logprob for x in c.logprobs.content] == pytest.approx(ep.seen[0][2].tolist())
    assert r2.choices[0].message.content == "The answer is 42." and r2.choices[0].finish_reason == "stop"
    t = ep.session.trajectory()
    check_exact(tok, t, ep.seen)
    assert t["metrics"]["segments"] == 1 and t["metrics"]["assistant_tokens_reused"] == len(ep.seen[0][1])
    turn = t["turns"][0]
    obs = tok.decode(t["response_ids"][turn["obs_start"]:turn["obs_end"]].tolist())
    assert obs == ("\n<|im_start|>user\n<tool_response>\na.py\n</tool_response>\n<tool_response>\nprint(42)\n"
                   "</tool_response><|im_end|>\n<|im_start|>assistant\n")


def test_streaming_gives_the_same_reply_and_trajectory(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    call = 'Checking.\n<tool_call>\n{"name": "bash", "arguments": {"command": "ls"}}\n</tool_call>'
    be = scripted(tok, Script(tok, [call, "Done."]))

    async def main():
        async with Endpoint(tok, be.url) as ep:
            msgs = [{"role": "user", "content": "go"}]
            stream = await ep.client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True,
                                                             stream_options={"include_usage": True})
            chunks = [ch async for ch in stream]
            content = "".join(ch.choices[0].delta.content or "" for ch in chunks if ch.choices)
            tcs = [tc for ch in chunks if ch.choices for tc in (ch.choices[0].delta.tool_calls or [])]
            finish = [ch.choices[0].finish_reason for ch in chunks if ch.choices and ch.choices[0].finish_reason]
            usage = [ch.usage for ch in chunks if ch.usage]
            msgs.append({"role": "assistant", "content": content, "tool_calls": [
                {"id": tc.id, "type": "function", "function": {"name": tc.function.name,
                                                               "arguments": tc.function.arguments}} for tc in tcs]})
            msgs.append({"role": "tool", "tool_call_id": tcs[0].id, "content": "x"})
            stream = await ep.client.chat.completions.create(model="m", messages=msgs, tools=TOOLS, stream=True)
            last = "".join([ch.choices[0].delta.content or "" async for ch in stream if ch.choices])
            return ep, content, tcs, finish, usage, last

    ep, content, tcs, finish, usage, last = arun(main())
    assert content == "Checking." and finish == ["tool_calls"] and last == "Done."
    assert [(tc.function.name, json.loads(tc.function.arguments)) for tc in tcs] == [("bash", {"command": "ls"})]
    assert len(usage) == 1 and usage[0].completion_tokens == len(ep.seen[0][1])
    t = ep.session.trajectory()
    assert t["metrics"]["segments"] == 1
    check_exact(tok, t, ep.seen)


def test_history_rewrite_opens_a_segment(qwen_tokenizer, scripted, arun):
    """An agent that summarizes its history: the second segment is rendered from the rewritten
    messages; each segment is self-consistent and the last one is the top level."""
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, ["step one", "step two", "final"]))

    async def main():
        async with Endpoint(tok, be.url) as ep:
            msgs = [{"role": "user", "content": "task"}]
            r = await ep.client.chat.completions.create(model="m", messages=msgs)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "more"}]
            r = await ep.client.chat.completions.create(model="m", messages=msgs)
            # the agent compresses: drops the first exchange, keeps its last reply verbatim
            short = [{"role": "user", "content": "task (summary: did step one)"},
                     {"role": "assistant", "content": r.choices[0].message.content},
                     {"role": "user", "content": "finish"}]
            await ep.client.chat.completions.create(model="m", messages=short)
            return ep, short

    ep, short = arun(main())
    t = ep.session.trajectory()
    segs = t["segments"]
    assert [s["index"] for s in segs] == [0, 1] and t["metrics"]["segments"] == 2
    check_exact(tok, segs[0], ep.seen[:2])
    check_exact(tok, segs[1], ep.seen[2:])
    for k in ("prompt_ids", "response_ids", "loss_mask", "logprobs"):
        assert np.array_equal(t[k], segs[1][k])
    assert t["turns"] == segs[1]["turns"]
    # the new segment's prompt decodes to the template's rendering of the rewritten messages, the
    # kept reply in it as its sampled (non-canonical) ids, never a re-encoding of its text
    text = tok.apply_chat_template(short, add_generation_prompt=True, tokenize=False)
    prompt = segs[1]["prompt_ids"].tolist()
    assert tok.decode(prompt) == text and prompt != tok.encode(text, add_special_tokens=False)
    head = tok.encode(tok.apply_chat_template(short[:1], add_generation_prompt=True, tokenize=False),
                      add_special_tokens=False)
    assert prompt[:len(head) + len(ep.seen[1][1])] == list(head) + ep.seen[1][1]
    assert t["metrics"]["assistant_tokens_reencoded"] == 0
    assert t["metrics"]["assistant_tokens_reused"] == len(ep.seen[0][1]) + len(ep.seen[1][1])


def test_edited_reply_or_other_tools_open_a_segment(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, ["answer A", "answer B", "answer C"], split=False))

    async def main():
        async with Endpoint(tok, be.url) as ep:
            msgs = [{"role": "user", "content": "q"}]
            await ep.client.chat.completions.create(model="m", messages=msgs)
            edited = msgs + [{"role": "assistant", "content": "answer A, edited"}, {"role": "user", "content": "q2"}]
            await ep.client.chat.completions.create(model="m", messages=edited)
            same = edited[:1] + [{"role": "assistant", "content": "answer A, edited"}, {"role": "user", "content": "q2"},
                                 {"role": "assistant", "content": "answer B"}, {"role": "user", "content": "q3"}]
            await ep.client.chat.completions.create(model="m", messages=same, tools=TOOLS)  # tools appear
            return ep

    ep = arun(main())
    t = ep.session.trajectory()
    assert t["metrics"]["segments"] == 3
    for s, seen in zip(t["segments"], ep.seen):
        check_exact(tok, s, [seen])


def test_cancel_mid_call_aborts_the_backend_request(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, "constant:text=slow", latency=60.0)

    async def main():
        async with Endpoint(tok, be.url) as ep:
            ep.client = ep.client.with_options(max_retries=2)  # the refusal must not be retried anyway
            call = asyncio.ensure_future(ep.client.chat.completions.create(
                model="m", messages=[{"role": "user", "content": "hi"}]))
            while be.num_running < 1:  # the backend holds the request
                await asyncio.sleep(0.01)
            ep.session.cancel("cancelled")
            with pytest.raises(openai.APIStatusError) as ei:
                await call
            assert ei.value.status_code == 503 and ei.value.body["code"] == "job_cancelled"
            assert await asyncio.to_thread(be.wait_for, lambda b: b.stats["disconnects"] >= 1, 10)
            with pytest.raises(openai.APIStatusError) as ei:
                await ep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "again"}])
            assert ei.value.status_code == 503
            return ep

    ep = arun(main())
    assert be.stats["requests"] == 1  # the later call never reached the backend
    # two requests, both answered 503 (the SDK retried neither: x-should-retry: false)
    assert ep.session.metrics["requests"] == ep.session.metrics["refused_calls"] == 2
    t = ep.session.trajectory()
    assert t["metrics"]["segments"] == 0 and len(t["response_ids"]) == 0


def test_deadline_refuses_calls_and_cuts_one_in_flight(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, "constant:text=slow", latency=60.0)

    async def main():
        lim = EndpointLimits(max_context=4096)
        async with Endpoint(tok, be.url, limits=lim) as ep:
            # Set once the server is up (its start can take seconds on a loaded machine), with room
            # for the request to reach the backend (60 s away) before it passes.
            lim.deadline = time.monotonic() + 3.0
            with pytest.raises(openai.APIStatusError) as ei:  # runs into the deadline at the backend
                await ep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert ei.value.status_code == 503 and ei.value.body["code"] == "deadline_exceeded"
            assert await asyncio.to_thread(be.wait_for, lambda b: b.stats["disconnects"] >= 1, 10)
            with pytest.raises(openai.APIStatusError) as ei:  # after the deadline: refused at the door
                await ep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            assert ei.value.body["code"] == "deadline_exceeded"
        return ep

    arun(main())
    assert be.stats["requests"] == 1


def vllm_words(msg: str) -> None:
    """A context overflow in vLLM's words, with its numbers: Pi's overflow recovery (compact, then
    retry) matches "maximum context length is N tokens"; the Anthropic route turns the numbers into
    "prompt is too long: N tokens > 64 maximum", which Claude Code reads."""
    import re

    from rolloutd.endpoint.shapes.anthropic import error_body
    from rolloutd.endpoint.wire import bad

    m = re.match(r"This model's maximum context length is 64 tokens\. However, your prompt contains (\d+) input "
                 r"tokens, which exceeds this limit even without any output tokens\.", msg)
    assert m and int(m[1]) > 64, msg
    body = json.loads(error_body(bad(msg, "messages", "context_length_exceeded")))
    assert body["error"]["message"].startswith(f"prompt is too long: {m[1]} tokens > 64 maximum"), body


def test_n_greater_than_one_and_context_overflow_are_400(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, ["ok"]))

    async def main():
        async with Endpoint(tok, be.url, limits=EndpointLimits(max_context=64)) as ep:
            with pytest.raises(openai.BadRequestError) as ei:
                await ep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}], n=2)
            assert "n = 2" in ei.value.body["message"] and ei.value.body["param"] == "n"
            with pytest.raises(openai.BadRequestError) as ei:
                await ep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "x " * 200}])
            assert ei.value.body["code"] == "context_length_exceeded"
            vllm_words(ei.value.body["message"])
            # the first exchange fits; the next observation does not: refused, nothing recorded for it
            r = await ep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            msgs = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": r.choices[0].message.content},
                    {"role": "user", "content": "y " * 100}]
            with pytest.raises(openai.BadRequestError) as ei:
                await ep.client.chat.completions.create(model="m", messages=msgs)
            assert ei.value.body["code"] == "context_length_exceeded"
            vllm_words(ei.value.body["message"])
            return ep

    ep = arun(main())
    assert be.stats["requests"] == 1
    t = ep.session.trajectory()
    check_exact(tok, t, ep.seen)


def test_a_spent_call_budget_gets_a_last_message_not_a_sample(qwen_tokenizer, scripted, arun):
    """Past ``max_llm_calls`` a chat request gets a last assistant message (no calls, ``stop``),
    which every harness CLI treats as its final answer (a 429 it retries for minutes); nothing
    reaches the backend or the trajectory. ``/v1/completions`` still gets the final 429."""
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, ["ok"]))

    async def main():
        async with Endpoint(tok, be.url, limits=EndpointLimits(max_llm_calls=1)) as ep:
            ep.client = ep.client.with_options(max_retries=2)
            await ep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
            last = await ep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "b"}])
            streamed = await ep.client.chat.completions.create(model="m", stream=True,
                                                               messages=[{"role": "user", "content": "b"}])
            text = "".join([c.choices[0].delta.content or "" async for c in streamed if c.choices])
            with pytest.raises(openai.RateLimitError) as ei:
                await ep.client.completions.create(model="m", prompt="x")
            assert ei.value.body["code"] == "insufficient_quota"
            return ep, last, text

    ep, last, text = arun(main())
    c = last.choices[0]
    assert c.finish_reason == "stop" and not c.message.tool_calls and "budget of 1 LLM calls is spent" in c.message.content
    assert text == c.message.content
    m = ep.session.metrics
    assert m["budget_replies"] == 2 and m["llm_calls"] == 1 and m["refused_calls"] == 1 and be.stats["requests"] == 1
    t = ep.session.trajectory()
    assert len(t["turns"]) == 1 and "segments" not in t


def test_a_backend_refusal_never_names_the_backends_address(qwen_tokenizer, scripted, arun):
    """A backend's 400 (here a prompt longer than its smaller context window: vLLM 0.32, and so the
    stand-ins, only shorten a too-large ``max_tokens``) reaches the agent as a 400 that does not name
    the backend's address (issue 38)."""
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, ["ok"]), max_model_len=64)

    async def main():
        async with Endpoint(tok, be.url, limits=EndpointLimits(max_context=4096)) as ep:
            with pytest.raises(openai.BadRequestError) as ei:
                await ep.client.chat.completions.create(model="m", max_tokens=3000,
                                                        messages=[{"role": "user", "content": "hi " * 200}])
            return ei.value

    e = arun(main())
    host = be.url.split("//", 1)[1]
    msg = json.dumps(e.body)
    assert "maximum context length" in msg and host not in msg and be.url not in msg, msg
    assert "127.0.0.1" not in msg


def test_unix_socket_models_completions_and_bad_requests(qwen_tokenizer, scripted, arun, tmp_path):
    """Over a Unix socket (what the sandbox relay connects to): /v1/models, /v1/completions with a
    token-id prompt (its own segment), stop strings, and clear errors for bad bodies."""
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, ["alpha beta STOP gamma", "chat reply"]))
    sock = str(tmp_path / "llm.sock")

    async def main():
        async with Endpoint(tok, be.url, uds=sock) as ep:
            models = await ep.client.models.list()
            assert [m.id for m in models.data] == ["rolloutd"]
            prompt = tok.encode("Once upon a time", add_special_tokens=False)
            c = await ep.client.completions.create(model="m", prompt=prompt, max_tokens=50, stop=["STOP"],
                                                   logprobs=1)
            await ep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            stream = await ep.client.completions.create(model="m", prompt="Hello", max_tokens=20, stream=True)
            streamed = "".join([ch.choices[0].text async for ch in stream if ch.choices])
            assert streamed == tok.decode(ep.seen[-1][1], skip_special_tokens=True)
            async with httpx_lib.AsyncClient(transport=httpx_lib.AsyncHTTPTransport(uds=sock), timeout=10) as h:
                bad = await h.post("http://localhost/v1/chat/completions", content=b"{not json")
                nomsg = await h.post("http://localhost/v1/chat/completions", json={"messages": []})
                img = await h.post("http://localhost/v1/chat/completions", json={"messages": [
                    {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}]})
                missing = await h.get("http://localhost/v1/nothing")
                get = await h.get("http://localhost/v1/chat/completions")
            return ep, c, [bad, nomsg, img, missing, get]

    ep, c, errs = arun(main())
    assert c.choices[0].text == "alpha beta " and c.choices[0].finish_reason == "stop"
    assert [e.status_code for e in errs] == [400, 400, 400, 404, 405]
    for e in errs:
        err = e.json()["error"]
        assert set(err) == {"message", "type", "param", "code"} and err["message"]
    assert "image_url" in errs[2].json()["error"]["message"]
    t = ep.session.trajectory()
    assert t["metrics"]["segments"] == 3
    raw = t["segments"][0]
    assert raw["prompt_ids"].tolist() == tok.encode("Once upon a time", add_special_tokens=False)
    # the tokens after the stop string were dropped: the segment ends with the one completing "STOP"
    kept = raw["response_ids"].tolist()
    assert kept == ep.seen[0][1][: len(kept)] and tok.decode(kept).endswith("STOP")
    assert np.array_equal(raw["logprobs"], ep.seen[0][2][: len(kept)])
    assert len(c.choices[0].logprobs.tokens) == len(kept)
    check_exact(tok, t["segments"][1], ep.seen[1:2])
    assert t["segments"][2]["response_ids"].tolist() == ep.seen[2][1]
    assert not (tmp_path / "llm.sock").exists()  # stop removes the socket file


def test_a_failed_call_sent_again_reuses_the_rendered_prompt(qwen_tokenizer, scripted, arun):
    """A backend failure after the new messages were rendered: 503 (retryable), nothing sampled;
    the agent's identical retry continues the same segment."""
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, ["first", "second"]))

    async def main():
        async with Endpoint(tok, be.url) as ep:
            msgs = [{"role": "user", "content": "one"}]
            r = await ep.client.chat.completions.create(model="m", messages=msgs)
            msgs += [{"role": "assistant", "content": r.choices[0].message.content}, {"role": "user", "content": "two"}]
            be.inject("500")
            with pytest.raises(openai.APIStatusError) as ei:
                await ep.client.chat.completions.create(model="m", messages=msgs)
            assert ei.value.status_code == 503 and ei.value.body["code"] == "backend_unavailable"
            assert ei.value.response.headers.get("x-should-retry") is None  # the SDK may retry this one
            cut = ep.session.trajectory()  # the messages rendered for the failed call are not in it
            assert cut["response_ids"].tolist() == ep.seen[0][1] and cut["turns"][0]["obs_start"] is None
            r = await ep.client.chat.completions.create(model="m", messages=msgs)
            assert r.choices[0].message.content == "second"
            return ep

    ep = arun(main())
    t = ep.session.trajectory()
    assert t["metrics"]["segments"] == 1 and be.stats["injected_500"] == 1
    check_exact(tok, t, ep.seen)


def test_api_key_is_checked(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, ["ok"]))

    async def main():
        async with Endpoint(tok, be.url, api_key="secret") as ep:
            with pytest.raises(openai.AuthenticationError):
                await ep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
            good = ep.client.with_options(api_key="secret")
            r = await good.chat.completions.create(model="m", messages=[{"role": "user", "content": "a"}])
            assert r.choices[0].message.content == "ok"
            return ep

    arun(main())
    assert be.stats["requests"] == 1


BAD_BODIES = [
    {"messages": "hello"},
    {"messages": [{"content": "no role"}]},
    {"messages": [{"role": "wizard", "content": "x"}]},
    {"messages": [{"role": "user", "content": 5}]},
    {"messages": [{"role": "user", "content": "x", "tool_calls": [{"function": {"name": "f"}}]}]},
    {"messages": [{"role": "assistant", "content": None, "tool_calls": [{"function": {"arguments": "{}"}}]}]},
    {"messages": [{"role": "user", "content": "x"}], "temperature": "hot"},
    {"messages": [{"role": "user", "content": "x"}], "temperature": 9},
    {"messages": [{"role": "user", "content": "x"}], "max_tokens": 0},
    {"messages": [{"role": "user", "content": "x"}], "tools": {"bash": 1}},
    {"messages": [{"role": "user", "content": "x"}], "tools": [{"type": "function"}]},
    {"messages": [{"role": "user", "content": "x"}], "tool_choice": "always"},
    {"messages": [{"role": "user", "content": "x"}], "tool_choice": "auto"},
    {"messages": [{"role": "user", "content": "x"}], "stop": [1, 2]},
    {"messages": [{"role": "user", "content": "x"}], "stop_token_ids": ["a"]},
    {"messages": [{"role": "user", "content": "x"}], "response_format": {"type": "json_schema"}},
    [1, 2, 3],
]


def test_bad_requests_get_a_clear_400_and_change_nothing(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, Script(tok, ["fine"]))

    async def main():
        async with Endpoint(tok, be.url) as ep:
            base = ep.server.base_url
            async with httpx_lib.AsyncClient(timeout=30) as h:
                replies = [await h.post(base + "/chat/completions", json=b) for b in BAD_BODIES]
                replies.append(await h.post(base + "/completions", json={"prompt": {"a": 1}}))
                replies.append(await h.post(base + "/completions", json={"prompt": [1, "x"]}))
                ok = await h.post(base + "/chat/completions", json={"messages": [{"role": "user", "content": "x"}]})
            return ep, replies, ok

    ep, replies, ok = arun(main())
    for body, r in zip(BAD_BODIES + ["prompt dict", "prompt mixed"], replies):
        assert r.status_code == 400, (body, r.text)
        err = r.json()["error"]
        assert err["type"] == "invalid_request_error" and len(err["message"]) > 10, (body, err)
    assert ok.status_code == 200 and ok.json()["choices"][0]["message"]["content"] == "fine"
    assert be.stats["requests"] == 1
    t = ep.session.trajectory()
    assert t["metrics"]["segments"] == 1
    check_exact(tok, t, ep.seen)


class AbortOnce(Policy):
    """The first generation is cut by a server-side abort (a weight swap); the rest continues it."""

    def __init__(self, tok):
        super().__init__()
        self.tok, self.calls = tok, 0

    def reply(self, request):
        self.calls += 1
        if self.calls == 1:
            return PolicyReply(text="Hello wor", finish="abort")
        return PolicyReply(text="ld!")


def test_a_server_side_abort_is_continued_within_the_request(qwen_tokenizer, scripted, arun):
    tok = qwen_tokenizer
    be = scripted(tok, AbortOnce(tok))

    async def main():
        async with Endpoint(tok, be.url) as ep:
            r = await ep.client.chat.completions.create(model="m", messages=[{"role": "user", "content": "hi"}])
            return ep, r

    ep, r = arun(main())
    assert r.choices[0].message.content == "Hello world!" and r.choices[0].finish_reason == "stop"
    assert r.usage.completion_tokens == sum(len(ids) for _, ids, _ in ep.seen)
    t = ep.session.trajectory()
    assert [x["continuation"] for x in t["turns"]] == [False, True]
    assert [x["finish_reason"] for x in t["turns"]] == ["abort", "stop"]
    assert t["metrics"]["aborts"] == 1 and t["metrics"]["segments"] == 1
    check_exact(tok, t, ep.seen)
