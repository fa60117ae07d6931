"""Every coding-harness preset end to end (issue 25 items 3-5): the real, unmodified CLI at its
pinned version (npm ones from the agent venv's ``node`` cache, aider from PyPI), headless, in a
real bwrap sandbox without a network, through ``rolloutd up``, against the scripted backend with
the tiny model's real tokenizer and :class:`PresetOracle`, which reads the tools the harness
offers from the rendered prompt and answers with that harness's own shell tool (aider: its
SEARCH/REPLACE edit format) as hermes tool calls.

Per preset, two swe tasks: key 0 right (reward 1), key 1 wrong (reward 0, ``wrong_every=2``).
Token fidelity, per job:

* every sampled turn (``loss_mask == 1``) is, in order, exactly the ids the backend emitted for
  exactly that prompt (the backend's policy records prompt -> emitted ids);
* every prompt the backend saw decodes to the chat template's rendering of the messages and tools
  that the harness's request translates to (the endpoint's own wire parsers; the requests are
  recorded by ``[handlers.harness] record_requests``), one rendering per generating request.

The Anthropic (claude-code), Responses (codex) and Gemini (gemini-cli) presets need those routes
on the endpoint; where a route is not served yet, the preset's test says which one is missing:
a skip, or under ROLLOUTD_TEST_STRICT=1 (CI) a failure.
"""
from __future__ import annotations

import json
import os
import shutil
import tempfile
import threading
import unicodedata
from pathlib import Path

import pytest

from rolloutd.backends.policies import Policy
from tests.harness.conftest import harness_deployment, long_prompt_backend, recorded_rows
from tests.harness.test_harness_live import gather, swe_ids, well_formed

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1500)]

# preset -> the generating route it needs (None: Chat Completions, served today)
PRESET_ROUTES = {"qwen-code": None, "opencode": None, "pi": None, "aider": None,
                 "claude-code": ("POST", "/v1/messages", {"model": "m", "max_tokens": 1, "messages": []}),
                 "codex": ("POST", "/v1/responses", {"model": "m", "input": "hi"}),
                 "gemini-cli": ("POST", "/v1beta/models/m:generateContent", {"contents": []})}
# Segments per episode: the main conversation, plus one per side conversation (opencode names its
# session with a title call on its small model, before or between main calls: the endpoint keeps
# both conversations open, so the main one is never re-rendered).
SIDE_CALLS = {"opencode": 1}
GENERATING = ("/chat/completions", "/messages", "/responses", ":generateContent", ":streamGenerateContent")


class RecordingOracle(Policy):
    """HarnessOracle, with every reply's ids (the end-of-turn token included) recorded by prompt."""

    def __init__(self, tok_dir: str):
        from rolloutd.handlers.harness_presets import HarnessOracle
        from rolloutd.llm.tokenizer_utils import load_tokenizer

        super().__init__()
        self.inner = HarnessOracle(wrong_every=2)
        self.tok = load_tokenizer(tok_dir)
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.emitted: dict[tuple, list[list[int]]] = {}
        self.lock = threading.Lock()

    def warm(self):
        self.inner.warm()

    def reply(self, request):
        from rolloutd.backends.policies import PolicyReply

        text = self.inner.reply(request)
        ids = list(self.tok.encode(text, add_special_tokens=False)) + [self.eos]
        with self.lock:
            self.emitted.setdefault(tuple(request.prompt_ids), []).append(ids)
        return PolicyReply(token_ids=ids, append_eos=False)


def missing_route(preset: str) -> str | None:
    """The route this preset needs and the endpoint does not serve (404), or None."""
    spec = PRESET_ROUTES[preset]
    if spec is None:
        return None
    import asyncio

    from rolloutd.endpoint.app import make_app
    from rolloutd.endpoint.session import EndpointSession

    async def probe():
        async def generate(*a, **k):  # never reached: the probe bodies are refused or empty
            raise RuntimeError("probe")

        app = make_app(EndpointSession(generate, None))
        sent = []
        body = json.dumps(spec[2]).encode()
        done = False

        async def receive():
            nonlocal done
            if done:
                await asyncio.sleep(3600)
            done = True
            return {"type": "http.request", "body": body, "more_body": False}

        async def send(m):
            sent.append(m)

        path, _, query = spec[1].partition("?")
        scope = {"type": "http", "method": spec[0], "path": path, "raw_path": path.encode(), "query_string": b"",
                 "headers": [(b"content-type", b"application/json")], "http_version": "1.1", "scheme": "http",
                 "client": ("127.0.0.1", 1), "server": ("127.0.0.1", 2), "root_path": ""}
        try:
            await asyncio.wait_for(app(scope, receive, send), 10)
        except Exception:  # noqa: BLE001 - a route that exists may fail on the probe's dummies
            return None
        starts = [m for m in sent if m["type"] == "http.response.start"]
        text = b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")
        if starts and starts[0]["status"] == 404 and b"no route" in text:
            return f"{spec[0]} {spec[1]}"
        return None

    return asyncio.run(probe())


@pytest.fixture(scope="module")
def preset_backend(tok_dir):
    pol = RecordingOracle(tok_dir)
    pol.warm()
    yield from long_prompt_backend(tok_dir, pol)


@pytest.fixture(scope="module")
def record_dir():
    d = tempfile.mkdtemp(prefix="rd-req-", dir="/tmp")
    yield d
    shutil.rmtree(d, ignore_errors=True)


@pytest.fixture(scope="module")
def presets_up(module_up_factory, tok_dir, sandbox_root, agent_venv, preset_backend, record_dir):
    return harness_deployment(module_up_factory, tok_dir, sandbox_root, agent_venv, preset_backend.url,
                              record_requests=record_dir)


def preset_task(preset: str, i: int, task_id: str) -> dict:
    inst = {"preset": preset, "setup": {"domain": "swe", "instance": {"task_id": task_id}},
            "limits": {"max_llm_calls": 8, "wall_s": 600}}
    return {"handler": "harness", "instance_id": f"{preset}-{i}", "instance": inst}


@pytest.fixture(scope="module")
def preset_results(presets_up, swe_built):
    """Every runnable preset's two jobs, submitted at once (one episode each, concurrently)."""
    ids = swe_ids()
    runnable = [p for p in PRESET_ROUTES if missing_route(p) is None]
    tasks = [preset_task(p, i, ids[i]) for p in runnable for i in (0, 1)]
    results = gather(presets_up, tasks, timeout_s=1200)
    return {r["instance_id"]: r for r in results}


def _nfc(s: str) -> str:
    return unicodedata.normalize("NFC", s)


def translated(row: dict):
    """(messages as the template takes them, tools) of one recorded generating request."""
    from rolloutd.endpoint.shapes import chat

    body = json.loads(row["body"])
    path = row["path"]
    if path.endswith("/chat/completions"):
        msgs, tools = chat.parse_messages(body["messages"]), chat.parse_tools(body.get("tools"))
    elif path.endswith("/messages"):
        from rolloutd.endpoint.shapes import anthropic as anthropic_wire

        w = anthropic_wire.parse(body)
        msgs, tools = w.messages, w.tools
    elif path.endswith("/responses"):
        from rolloutd.endpoint.shapes import responses as responses_wire

        w = responses_wire.parse(body)
        msgs, tools = w.messages, w.tools
    else:
        from rolloutd.endpoint.shapes import gemini as gemini_wire

        model = path.rsplit("/", 1)[-1].split(":")[0]
        w = gemini_wire.parse(body, model=model, stream=":streamGenerateContent" in path)
        msgs, tools = w.messages, w.tools
    return [m.template_dict() for m in msgs], tools


def check_fidelity(r: dict, tok, emitted: dict, record_dir: str) -> None:
    segs = r.get("segments") or [r]
    prompts = []
    for seg in segs:
        p, resp = list(seg["prompt_ids"]), [int(x) for x in seg["response_ids"]]
        for t in seg["turns"]:
            s, e = t["span"]
            prompt = tuple(int(x) for x in p) + tuple(resp[:s])
            assert prompt in emitted, "a turn whose prompt the backend never saw"
            assert resp[s:e] in emitted[prompt], "a sampled turn differs from what the backend emitted"
            prompts.append(prompt)
    assert len(prompts) == r["metrics"]["llm_calls"]
    rows = [x for x in recorded_rows(record_dir, r) if x["status"] == 200 and x["method"] == "POST" and any(g in x["path"] for g in GENERATING)
            and "count" not in x["path"]]
    assert len(rows) == len(prompts), (len(rows), len(prompts), r["attempts"], [x["path"] for x in rows])
    seen = sorted(_nfc(tok.decode(list(p), skip_special_tokens=False)) for p in prompts)
    want = []
    for x in rows:
        msgs, tools = translated(x)
        want.append(_nfc(tok.apply_chat_template(msgs, tools=tools or None, add_generation_prompt=True,
                                                 tokenize=False)))
    assert sorted(want) == seen, "a prompt is not the chat template's rendering of its request"


@pytest.mark.parametrize("preset", list(PRESET_ROUTES))
def test_preset_solves_swe_with_its_own_tools(preset, request, preset_backend, record_dir):
    missing = missing_route(preset)
    if missing is not None:
        msg = f"the endpoint does not serve {missing}, which the {preset} preset needs (issue 25 item 1)"
        if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":
            pytest.fail("ROLLOUTD_TEST_STRICT=1: " + msg)
        pytest.skip(msg)
    from rolloutd.handlers.harness_presets import NPM_PACKAGES, PRESETS, node_bin

    binary = PRESETS[preset]["command"][0]
    venv = request.getfixturevalue("agent_venv")
    if preset in NPM_PACKAGES and not os.path.exists(os.path.join(node_bin(venv), binary)):
        msg = f"{binary} is not in the agent venv's npm cache ({node_bin(venv)}): no npm on this machine"
        if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":
            pytest.fail("ROLLOUTD_TEST_STRICT=1: " + msg)
        pytest.skip(msg)
    results = request.getfixturevalue("preset_results")
    right, wrong = results[f"{preset}-0"], results[f"{preset}-1"]
    for r in (right, wrong):
        agent = r["eval_details"].get("agent") or {}
        assert r["status"] == "ok", (r["instance_id"], r["failed_phase"], r["error"], agent.get("output_tail", "")[-3000:])
        assert agent["exit_code"] == 0
        well_formed(r)
        check_fidelity(r, preset_backend.policy.tok, preset_backend.policy.emitted, record_dir)
        assert r["metrics"]["assistant_tokens_reencoded"] == 0, r["metrics"]  # histories sent back unchanged
        assert r["metrics"]["segments"] == 1 + SIDE_CALLS.get(preset, 0), r["metrics"]
        assert all(t["policy_version"] == 0 for s in (r.get("segments") or [r]) for t in s["turns"])
    assert right["reward"] == 1.0 and right["eval_details"]["resolved"] is True, right["eval_details"]
    assert wrong["reward"] == 0.0 and wrong["eval_details"]["resolved"] is False, wrong["eval_details"]
    assert right["eval_details"]["patch"] and wrong["eval_details"]["patch"]  # both edited the repository


def test_demo_runs_the_claude_code_and_codex_presets(tmp_path, request):
    """``rolloutd demo --domains harness --harness-presets claude-code,codex`` (issue 25 item 7), in a
    child process like a user runs it: both presets solve the first swe task (reward 1)."""
    import subprocess
    import sys
    import uuid

    from tests.conftest import require_bwrap, tagged_pids

    need = [m for m in (missing_route("claude-code"), missing_route("codex")) if m]
    if need:
        msg = f"the endpoint does not serve {', '.join(need)}, which the demo's claude-code and codex presets need"
        if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":
            pytest.fail("ROLLOUTD_TEST_STRICT=1: " + msg)
        pytest.skip(msg)
    require_bwrap()
    agent_venv = request.getfixturevalue("agent_venv")
    request.getfixturevalue("swe_built")
    out = tmp_path / "traj.jsonl"
    tag = f"presets-demo-{uuid.uuid4().hex}"
    p = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "demo", "--domains", "harness",
                        "--harness-presets", "claude-code,codex", "--per-domain", "1", "--no-progress",
                        "--agent-venv", agent_venv, "--out", str(out)],
                       cwd=Path(__file__).resolve().parents[2], capture_output=True, text=True, timeout=900,
                       env=dict(os.environ, COLUMNS="160", ROLLOUTD_TEST_DEMO_TAG=tag))
    assert p.returncode == 0, p.stdout[-4000:] + p.stderr[-4000:]
    rows = [json.loads(line) for line in out.read_text().splitlines()]
    assert sorted(r["instance_id"].split("/")[1] for r in rows) == ["claude-code", "codex"]
    assert all(r["status"] == "ok" and r["reward"] == 1.0 for r in rows), [r["eval_details"] for r in rows]
    assert not tagged_pids(tag)
