"""Anthropic's ``stop_sequence``: a reply ended by one of the request's ``stop_sequences``
answers ``stop_reason: "stop_sequence"`` and names the string, streaming and not (the real
``anthropic`` SDK as the client, a real uvicorn socket, the scripted vLLM-API backend writing past
the stop string). Before, the endpoint never said which stop string ended a reply: the SDK saw
``end_turn`` and ``stop_sequence: None``, and the trajectory still ended at the stop."""
from __future__ import annotations

import pytest

anthropic = pytest.importorskip("anthropic", reason="the anthropic SDK is not installed (pip install rolloutd[harness])")

from rolloutd.llm.client import LLMClient, simple_generate
from rolloutd.endpoint.app import make_app
from rolloutd.endpoint.bounds import EndpointLimits
from rolloutd.endpoint.server import serve
from rolloutd.endpoint.session import EndpointSession

pytestmark = pytest.mark.timeout(120)


@pytest.mark.parametrize("stream", [False, True])
def test_a_stop_sequence_is_named_in_the_reply(arun, qwen_tokenizer, scripted, stream):
    tok = qwen_tokenizer
    be = scripted(tok, 'constant:text="The answer is 42. END and then more text"')

    async def go():
        async with LLMClient(be.url, timeout=60) as llm:
            session = EndpointSession(simple_generate(llm, "b0", 0), tok,
                                      limits=EndpointLimits(max_context=4096, max_tokens=64))
            server = await serve(make_app(session), host="127.0.0.1", port=0)
            client = anthropic.AsyncAnthropic(base_url=f"http://127.0.0.1:{server.port}", api_key="k", max_retries=0)
            try:
                kw = dict(model="claude-sonnet-4-5", max_tokens=64, stop_sequences=["END", "NEVER"],
                          messages=[{"role": "user", "content": "What is the answer?"}])
                if stream:
                    async with client.messages.stream(**kw) as s:
                        msg = await s.get_final_message()
                else:
                    msg = await client.messages.create(**kw)
            finally:
                await client.close()
                await server.stop()
            return msg, session.trajectory()

    msg, traj = arun(go())
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == "END"
    assert [b.text for b in msg.content if b.type == "text"] == ["The answer is 42. "]
    sampled = tok.decode(traj["response_ids"][traj["loss_mask"] == 1], skip_special_tokens=False)
    assert "END" in sampled and "more text" not in sampled  # cut after the token completing the stop
