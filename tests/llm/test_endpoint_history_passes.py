"""The resent history compared at C speed (issue 40 item 4): ``same_prefix``/``same_objects``
answer what the per-item loops they replaced answered, and a conversation that matched a request
is compared again from scratch when a later request edits a message it had matched (the
per-segment shortcut must never extend a conversation whose history the agent changed).
Real parts for the second: the ``openai`` SDK as the agent, a real uvicorn socket, the real Qwen2.5
tokenizer and its template, the scripted vLLM-API backend."""
from __future__ import annotations

import asyncio
import math

import pytest
from hypothesis import given, settings, strategies as st

from rolloutd.endpoint.wire import same_objects, same_prefix

from .test_endpoint_forks import Agent, check_segments, user

pytestmark = pytest.mark.timeout(300)

SHARED = [{"role": "user", "content": "a"}, {"role": "tool", "content": [1, 2]}, "x", 3, None, math.nan]


def naive_equal(a: list, b: list) -> int:
    k = 0
    while k < min(len(a), len(b)) and (a[k] is b[k] or a[k] == b[k]):
        k += 1
    return k


def naive_same(a: list, b: list) -> int:
    k = 0
    while k < min(len(a), len(b)) and a[k] is b[k]:
        k += 1
    return k


# items: one of a few shared objects (the history cache's reuse), or an equal copy, or another value
item = st.one_of(st.sampled_from(range(len(SHARED))).map(lambda i: ("same", i)),
                 st.sampled_from(range(len(SHARED) - 1)).map(lambda i: ("copy", i)),
                 st.text(max_size=3).map(lambda s: ("other", s)))


def build(spec: list) -> list:
    import copy

    return [SHARED[v] if k == "same" else copy.deepcopy(SHARED[v]) if k == "copy" else v for k, v in spec]


@settings(max_examples=300, deadline=None)
@given(st.lists(item, max_size=12), st.lists(item, max_size=12), st.integers(0, 12))
def test_same_prefix_and_same_objects_answer_as_the_item_loops(xs, ys, common):
    """``ys`` starts with ``xs``' first ``common`` items (the same objects: a resent history)."""
    a = build(xs)
    b = a[:common] + build(ys)
    assert same_prefix(a, b) == naive_equal(a, b)
    assert same_prefix(b, a) == naive_equal(b, a)
    assert same_objects(a, b) == naive_same(a, b)
    assert same_objects(b, a) == naive_same(b, a)


def test_a_nan_resent_as_the_same_object_matches_and_an_equal_copy_does_not():
    nan = float("nan")
    assert same_prefix([{"x": nan}, 1], [{"x": nan}, 1]) == 2  # the same float object inside: equal dicts
    assert same_prefix([{"x": float("nan")}], [{"x": float("nan")}]) == 0
    assert same_prefix([], [1]) == same_objects([], [1]) == 0


@pytest.mark.parametrize("edit", ["system", "first user message"])
def test_an_edited_earlier_message_is_not_an_extension(qwen_tokenizer, scripted, edit):
    """Three calls extend one conversation (the second and third compared from the matched
    prefix on); a fourth resends the whole history, our three replies included, plus a new
    message, with an earlier message changed (same length, same roles): it must not extend that
    conversation, and its prompt is its own messages' rendering. (With the matched prefix taken
    on trust, the fourth extended the first conversation: checked.)"""
    be = scripted(qwen_tokenizer, "echo")

    async def episode():
        async with Agent(qwen_tokenizer, be.url) as ag:
            main = [{"role": "system", "content": "Be brief."}, user("hello")]
            for q in ("what is 2+2?", "and 3+3?"):
                main.append(await ag.chat(main))
                main.append(user(q))
            main.append(await ag.chat(main))
            edited = [dict(m) for m in main] + [user("and 4+4?")]
            at = 0 if edit == "system" else 1
            edited[at]["content"] = edited[at]["content"].upper()
            await ag.chat(edited)
            return ag.session.trajectory(), ag

    traj, ag = asyncio.run(episode())
    m = traj["metrics"]
    assert m["llm_calls"] == 4 and m["segments"] == 2 and m["forks"] == 0, m
    segs = check_segments(traj, ag, qwen_tokenizer)  # every prompt decodes to its call's messages
    assert [len(s["turns"]) for s in segs] == [3, 1]


@settings(max_examples=300, deadline=None)
@given(st.lists(st.lists(st.tuples(st.booleans(), st.integers(0, 30)), max_size=8), min_size=1, max_size=6),
       st.integers(1, 4))
def test_the_size_check_counts_what_a_whole_count_would(requests, mbpt):
    """Each request keeps a prefix of the last one's very messages (True: the next shared one)
    or brings new ones; ``SizeCheck`` counts only the new but refuses exactly what a count of
    every character refuses, however the history was kept, shortened or replaced."""
    from rolloutd.endpoint.bounds import SizeCheck
    from rolloutd.endpoint.wire import EndpointError, Msg

    check, last, max_context = SizeCheck(), [], 40
    for spec in requests:
        msgs, i = [], 0
        for keep, n in spec:
            if keep and i < len(last) and len(msgs) == i:
                msgs.append(last[i])  # the same object, as a parse reuses a resent message
                i += 1
            else:
                msgs.append(Msg(role="tool", content="x" * n))
        whole = sum(len(m.content) for m in msgs)
        try:
            check.check(msgs, mbpt, max_context)
            refused = None
        except EndpointError as e:
            refused = str(e)
        assert (refused is not None) == (whole > mbpt * max_context), (whole, refused)
        if refused:
            assert f"hold {whole} characters" in refused
        last = msgs


def test_the_size_check_counts_a_list_that_grew_in_place_after_it_was_checked():
    from rolloutd.endpoint.bounds import SizeCheck
    from rolloutd.endpoint.wire import EndpointError, Msg

    check = SizeCheck()
    msgs = [Msg(role="user", content="x" * 10)]
    check.check(msgs, 1, 25)
    msgs.append(Msg(role="tool", content="y" * 20))  # the same list object, longer: 30 characters > 25
    with pytest.raises(EndpointError, match="hold 30 characters"):
        check.check(msgs, 1, 25)
