"""Each coding preset compacts its own history for real, and no sampled token is re-encoded (issue 37
item 4). The real CLIs at their pins, in bwrap through ``rolloutd up``, the scripted backend with
the tiny model's tokenizer playing :class:`~rolloutd.handlers.harness_episodes.EpisodePolicy`: echo
steps through the harness's shell tool, a summary when the harness asks for one. Each harness
compacts through its own setting (``compaction_instance``: Codex's
``model_auto_compact_token_limit``, Claude Code's auto-compact window, OpenCode's and Pi's model
limits, Qwen Code's ``context.autoCompactThreshold``, Gemini CLI's ``model.compressionThreshold``),
put a few steps past the preset's first prompt, which a one-call probe job measures first.

Per preset: the job ends ``ok`` (exit 0), the harness sent its compaction request, the episode
went on after it (Pi: its headless run ends after the request it retries), every sampled turn is
what the backend emitted for that exact prompt, every prompt decodes to the chat template's
rendering of its request, and ``assistant_tokens_reencoded`` is 0: the compaction requests and
compacted histories that carry our replies (Codex's ``tools: []`` summary request, Qwen Code's
kept call, Claude Code's kept steps) hold them as their sampled ids. On the code before the
splice (3997a24^) Codex, Claude Code and OpenCode re-encoded 39, 34 and 9 tokens (bench_merge),
and Gemini CLI and Qwen Code did not compact at all (the keys tried were not theirs)."""
from __future__ import annotations

import threading

import pytest

from rolloutd.backends.policies import Policy, PolicyReply
from tests.harness.conftest import harness_deployment, long_prompt_backend, recorded_rows
from tests.harness.test_harness_live import gather, well_formed
from tests.harness.test_presets import check_fidelity

pytestmark = [pytest.mark.slow, pytest.mark.timeout(2400)]

PRESETS = ["codex", "claude-code", "opencode", "pi", "qwen-code", "gemini-cli"]
# Gemini CLI splits its history for compression at a user message that is not a tool result: in a
# headless run only its "Please continue." after a reply without a call (next-speaker check on).
KNOBS = {"gemini-cli": {"pause_at": 5}, "claude-code": {"steps": 12}}


class RecordingEpisode(Policy):
    """EpisodePolicy, with every reply's ids (the end-of-turn token included) recorded by prompt."""

    def __init__(self, tok_dir: str):
        from rolloutd.handlers.harness_episodes import EpisodePolicy
        from rolloutd.llm.tokenizer_utils import load_tokenizer

        super().__init__()
        self.inner = EpisodePolicy(0)
        self.tok = load_tokenizer(tok_dir)
        self.eos = self.tok.convert_tokens_to_ids("<|im_end|>")
        self.emitted: dict[tuple, list[list[int]]] = {}
        self.lock = threading.Lock()

    def reply(self, request):
        out = self.inner.reply(request)
        text = out.text if isinstance(out, PolicyReply) else out
        ids = list(self.tok.encode(text, add_special_tokens=False)) + [self.eos]
        with self.lock:  # as the backend sends them: cut at max_tokens (the room the window leaves)
            self.emitted.setdefault(tuple(request.prompt_ids), []).append(ids[:request.max_tokens])
        return PolicyReply(token_ids=ids, append_eos=False)


@pytest.fixture(scope="module")
def backend(tok_dir):
    yield from long_prompt_backend(tok_dir, RecordingEpisode(tok_dir))


@pytest.fixture(scope="module")
def record_dir(tmp_path_factory):
    return str(tmp_path_factory.mktemp("rec"))


def job(preset: str, name: str, steps: int, at: int | None = None, **knobs) -> dict:
    from rolloutd.handlers.harness_episodes import compaction_instance, episode_task

    inst = {"preset": preset, "task": episode_task(steps, **knobs), "eval": {"command": ["true"]},
            "limits": {"max_llm_calls": 3 * steps + 10, "wall_s": 900}}
    if at is not None:
        extra = compaction_instance(preset, at)
        inst["limits"].update(extra.pop("limits", {}))
        inst.update(extra)
    return {"handler": "harness", "instance_id": name, "instance": inst}


def segments(r: dict) -> list[dict]:
    return r.get("segments") or [r]


@pytest.fixture(scope="module")
def results(module_up_factory, tok_dir, sandbox_root, agent_venv, backend, record_dir):
    """A one-call probe per preset (its first prompt's size), then each preset's compaction episode."""
    from rolloutd.handlers.harness_episodes import COMPACT_AFTER

    up = harness_deployment(module_up_factory, tok_dir, sandbox_root, agent_venv, backend.url, record_requests=record_dir)
    probes = {r["instance_id"]: r for r in gather(up, [job(p, p, 0) for p in PRESETS], timeout_s=1200)}
    base = {}
    for p, r in probes.items():
        assert r["status"] == "ok", (p, r["error"])
        base[p] = max(len(s["prompt_ids"]) + s["turns"][0]["start"] for s in segments(r))
    jobs = [job(p, p, **dict({"steps": 10}, **KNOBS.get(p, {})), at=base[p] + COMPACT_AFTER[p]) for p in PRESETS]
    out = {r["instance_id"]: r for r in gather(up, jobs, timeout_s=1800)}
    return out, base


@pytest.mark.parametrize("preset", PRESETS)
def test_the_preset_compacts_with_its_own_setting_and_nothing_is_reencoded(preset, results, backend, record_dir):
    from rolloutd.handlers.harness_episodes import SUMMARY_MARKERS

    out, base = results
    r = out[preset]
    agent = r["eval_details"].get("agent") or {}
    m = r["metrics"]
    print(f"\n{preset}: first prompt {base[preset]} tokens, llm_calls {m['llm_calls']}, segments {m['segments']}, "
          f"forks {m['forks']}, re-encoded {m['assistant_tokens_reencoded']}, reused {m['assistant_tokens_reused']}, "
          f"refused {m['refused_by_status']}, exit {agent.get('exit_code')}")
    assert r["status"] == "ok", (r["error"], agent.get("output_tail", "")[-3000:])
    assert agent["exit_code"] == 0, agent.get("output_tail", "")[-3000:]
    well_formed(r)
    rows = recorded_rows(record_dir, r)
    asked = [x for x in rows if x["status"] == 200 and any(k in x["body"] for k in SUMMARY_MARKERS)]
    assert asked, f"{preset} never sent its compaction request"
    tok = backend.policy.tok
    said = [tok.decode(list(s["response_ids"][t["start"]:t["end"]])) for s in segments(r) for t in s["turns"]]
    if preset == "pi":  # it compacts when a request overflows the window, retries it, and its -p run ends
        assert m["refused_by_status"].get("400 context_length_exceeded", 0) >= 1, m
        assert rows.index(asked[-1]) < len(rows) - 1, "no request after the compaction"
    else:
        assert any(x.startswith("All steps done.") for x in said), said[-4:]  # the episode went on to its end
    check_fidelity(r, tok, backend.policy.emitted, record_dir)
    assert m["assistant_tokens_reencoded"] == 0, m
    assert m["segments"] >= 2 and m["fork_fallbacks"] == 0, m
