"""Whatever a job sampled through its LLM lease is in its trajectory when it fails, times out or
is cancelled, for every built-in handler that samples and for a handler that never registers a
conversation (issue 28 item 3: synthetic_llm returned 0 tokens after 8 sampled calls).

One ``rolloutd up`` for the module; each test has its own scripted backend (real HTTP), so the
backend's count of completed calls is this job's: the trajectory must hold one turn per
completed call (the call in flight at the timeout or cancel is aborted and sampled nothing the
job saw, so the last completed one may also be lost in that race: one turn of slack)."""
from __future__ import annotations

import numpy as np
import pytest

from rolloutd.backends.policies import get_policy
from tests.conftest import wait_for

TOOL_CALL = '<tool_call>\n{"name": "python", "arguments": {"code": "print(1)"}}\n</tool_call>'


@pytest.fixture(scope="module")
def up(module_up_factory, quiet_sampler_entry_point, tiny_tokenizer_dir):
    return module_up_factory(f"handlers.dialogue.tokenizer={tiny_tokenizer_dir}",
                             f"handlers.math.tokenizer={tiny_tokenizer_dir}", "handlers.math.python=false")


@pytest.fixture
def backend(tokenizer, scripted):
    return lambda text="ok": scripted(tokenizer, get_policy("constant", text=text), latency=0.15)


# handler, instance (runs far longer than the test lets it), what the scripted model says
CASES = {
    "synthetic_llm": ({"llm_calls": 10_000, "max_tokens": 4}, "ok"),
    "quiet_sampler": ({}, "ok"),  # a custom handler: no ctx.conversation, no trajectory until the end
    "dialogue": ({"messages": [{"role": "user", "content": "hi"}], "user_turns": ["and?"] * 10_000}, "ok"),
    # ToolAgentHandler, the base of math, code and swe: a tool call every turn (its python tool is off,
    # so each gets an error observation and the loop asks again).
    "math": ({"question": "1+1?", "answer": "2", "max_turns": 10_000, "task_tag": False}, TOOL_CALL),
}


def check_tokens(r, b, prompt_check=None):
    turns = r["turns"]
    done = b.stats["completed"]
    assert done >= 2, f"the test needs at least two completed calls, the backend completed {done}"
    assert done - 1 <= len(turns) <= done, (len(turns), done, r["error"])
    mask = np.asarray(r["loss_mask"])
    resp = np.asarray(r["response_ids"])
    lps = np.asarray(r["logprobs"])
    assert len(resp) == len(mask) == len(lps) and len(r["prompt_ids"]) > 0
    spans = [t["span"] for t in turns]
    assert int(mask.sum()) == sum(e - s for s, e in spans) > 0
    for s, e in spans:
        assert np.all(mask[s:e] == 1) and np.all(lps[s:e] < 0)
        assert turns[0]["backend"] == b.url
    assert r["policy_version"] == 0
    if prompt_check:
        prompt_check(r)


def quiet_layout(r):
    """The custom handler's own sequence: prompt 1..8, then each call's tokens and [7, 7, 7]."""
    assert np.asarray(r["prompt_ids"]).tolist() == list(range(1, 9))
    resp, mask = np.asarray(r["response_ids"]), np.asarray(r["loss_mask"])
    for (s, e), nxt in zip([t["span"] for t in r["turns"]], [t["span"] for t in r["turns"]][1:]):
        assert nxt[0] - e == 3 and resp[e:nxt[0]].tolist() == [7, 7, 7] and not mask[e:nxt[0]].any()


@pytest.mark.parametrize("handler", list(CASES))
@pytest.mark.parametrize("how", ["timeout", "cancel"])
def test_a_job_that_ends_early_keeps_what_it_sampled(up, backend, handler, how):
    instance, text = CASES[handler]
    b = backend(text)
    task = {"handler": handler, "instance": instance}
    if how == "timeout":
        task["phase_timeouts"] = {"run": 6}  # a bound that leaves a loaded machine time for 2+ calls
    with up.client() as c:
        c.add_backend(b.url)
        try:
            (jid,) = c.submit([task])
            if how == "cancel":
                wait_for(lambda: b.stats["completed"] >= 3, timeout_s=60, what="three sampled calls")
                c.cancel([jid])
            (r,) = c.gather([jid], timeout_s=90)
        finally:
            c.clear_backends()
    want = {"timeout": "timeout", "cancel": "cancelled"}[how]
    assert r["status"] == want and r["failed_phase"] == "run", (r["status"], r["error"])
    check_tokens(r, b, quiet_layout if handler == "quiet_sampler" else None)


def test_a_custom_handler_that_raises_keeps_what_it_sampled(up, backend):
    b = backend()
    with up.client() as c:
        c.add_backend(b.url)
        try:
            (r,) = c.gather(c.submit([{"handler": "quiet_sampler", "instance": {"fail_after": 3}}]), timeout_s=60)
        finally:
            c.clear_backends()
    assert r["status"] == "failed" and r["error"]["type"] == "RuntimeError", r["error"]
    assert len(r["turns"]) == b.stats["completed"] == 3
    check_tokens(r, b, quiet_layout)
