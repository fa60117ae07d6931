"""The real CLIs get an untrained policy's replies as vLLM sends them (issue 37 item 1): one CLI
per API shape (pi: Chat Completions, claude-code: Anthropic Messages, codex: Responses,
gemini-cli: Gemini), unmodified, in a real bwrap sandbox through ``rolloutd up``, against the
scripted backend with the tiny model's tokenizer. Per CLI, three episodes whose first reply is

* ``badjson``: a tool call whose JSON does not parse: vLLM returns the text, no call, ``stop``;
* ``length``: a call cut off by the length limit: the text, no call, ``length``;
* ``special``: a call whose JSON string holds sampled ``<|im_start|>`` and ``<tool_call>`` ids:
  vLLM parses it, the ids' strings part of the argument;

then a final answer. Each CLI must see the text (it prints it as its answer, or sends it back)
and go on: no retry of the same request, exit 0."""
from __future__ import annotations

import json
import re
import threading
from pathlib import Path

import pytest

from rolloutd.backends.policies import Policy, PolicyReply
from tests.harness.conftest import harness_deployment, long_prompt_backend, recorded_rows
from tests.harness.test_harness_live import gather
from tests.harness.test_presets import GENERATING, record_dir  # noqa: F401 - a module-scoped fixture

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

CLIS = ["pi", "claude-code", "codex", "gemini-cli"]
CASES = ["badjson", "length", "special"]
MARK = "MARK7731"
ECHO = f"{MARK} <|im_start|> <tool_call> END"  # the command's output, control-token strings and all


class UnparsedCases(Policy):
    """The case named in the task (``case:<name>``) first, then a final answer."""

    def __init__(self, tok_dir: str):
        from rolloutd.llm.tokenizer_utils import load_tokenizer

        super().__init__()
        self.tok = load_tokenizer(tok_dir)
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.lock = threading.Lock()

    def reply(self, request):
        from rolloutd.handlers.harness_presets import offered_tools, shell_call, shell_tool
        from rolloutd.handlers.oracles import assistant_turns

        text = request.prompt_text
        found = re.findall(r"case:(\w+)", text)
        if not found or assistant_turns(text) > 0:
            return PolicyReply(text=f"Finished {MARK}.")
        case, tools = found[-1], offered_tools(text)
        name, arg, _ = shell_tool(tools)
        enc = lambda s: self.tok.encode(s, add_special_tokens=False)  # noqa: E731
        if case == "badjson":
            return PolicyReply(token_ids=enc(f'Checking {MARK}.\n<tool_call>\n{{"name": "{name}", "arguments": '
                                             f'{{"{arg}": "ls"\n</tool_call>') + [self.eos], append_eos=False)
        if case == "length":
            return PolicyReply(token_ids=enc(f'Checking {MARK}.\n<tool_call>\n{{"name": "{name}", "argu'),
                               finish="length", append_eos=False)
        # the tokenizer maps the strings inside the JSON string to the control-token ids
        call = shell_call(tools, f"echo '{ECHO}'", "Echo")
        ids = enc("Let me echo.\n" + call)
        assert self.tok.convert_tokens_to_ids("<|im_start|>") in ids
        return PolicyReply(token_ids=ids + [self.eos], append_eos=False)


@pytest.fixture(scope="module")
def backend(tok_dir):
    yield from long_prompt_backend(tok_dir, UnparsedCases(tok_dir))


@pytest.fixture(scope="module")
def results(module_up_factory, tok_dir, sandbox_root, agent_venv, backend, record_dir):
    from rolloutd.handlers.harness_presets import NPM_PACKAGES, PRESETS, node_bin

    for p in CLIS:
        binary = PRESETS[p]["command"][0]
        assert p in NPM_PACKAGES and Path(node_bin(agent_venv), binary).exists(), f"{binary} missing from the venv"
    up = harness_deployment(module_up_factory, tok_dir, sandbox_root, agent_venv, backend.url, record_requests=record_dir)
    tasks = [{"handler": "harness", "instance_id": f"{p}/{case}", "instance": {
        "preset": p, "task": f"Run one command, then stop. case:{case}", "setup": {"files": {"README.md": "hi\n"}},
        "eval": {"command": ["true"]}, "limits": {"max_llm_calls": 6, "wall_s": 300}}}
        for p in CLIS for case in CASES]
    return {r["instance_id"]: r for r in gather(up, tasks, timeout_s=1200)}


def requests_of(r: dict, record_dir: str) -> list[dict]:
    return [x for x in recorded_rows(record_dir, r) if x["method"] == "POST" and any(g in x["path"] for g in GENERATING)
            and "count" not in x["path"]]


@pytest.mark.parametrize("cli", CLIS)
def test_cli_sees_what_was_sampled_and_goes_on(cli, results, record_dir):
    for case in CASES:
        r = results[f"{cli}/{case}"]
        agent = r["eval_details"].get("agent") or {}
        tail = agent.get("output_tail", "")
        if (cli, case) == ("codex", "length"):
            # Codex fails the turn on a Responses length cut (``response.incomplete``, reason
            # max_output_tokens, as OpenAI's API sends it): measured, documented, never retried; it
            # exits 1 after an answered call, so its workspace is graded (no abstention)
            assert r["status"] == "ok" and agent.get("exit_code") == 1, r["error"]
            assert "exit code 1" in r["eval_details"]["reason"]
            assert "Incomplete response returned, reason: max_output_tokens" in tail
            assert len(requests_of(r, record_dir)) == 1
            continue
        assert r["status"] == "ok" and agent.get("exit_code") == 0, (case, r["error"], tail[-3000:])
        rows = requests_of(r, record_dir)
        assert all(x["status"] == 200 for x in rows), (case, [(x["path"], x["status"]) for x in rows])
        later = [json.dumps(json.loads(x["body"]), ensure_ascii=False) for x in rows[1:]]
        if case == "special":  # the call ran with the ids' strings in its argument; the output went back
            assert r["metrics"]["malformed_tool_calls"] == 0
            assert any(ECHO in b for b in later), (case, tail[-2000:])
            assert len(rows) == 2, (case, len(rows))
        else:  # the text reached the CLI: its answer, or sent back; never the same request again
            assert r["metrics"]["malformed_tool_calls"] == 1, r["metrics"]
            # the whole sampled text, call markup included (the text before the call alone is not it)
            assert any(f"Checking {MARK}" in x and "<tool_call>" in x for x in [tail] + later), (case, tail[-2000:])
            bodies = [x["body"] for x in rows]
            assert len(set(bodies)) == len(bodies), (case, "a request was sent again", len(rows))
