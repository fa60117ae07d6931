"""Scripted multi-call episodes for the coding-harness presets: what a model does in them, and how
each harness is made to compact its own history.

:class:`EpisodePolicy` (a scripted-backend policy, stateless but for retries) plays an episode of
N steps through whatever harness sent the prompt: each step runs ``echo rolloutd-step-<k>``
through the shell tool the harness offers (read from the ``<tools>`` block the chat template
rendered), then a final answer without a call ends the run. The step comes from the prompt
(the highest ``rolloutd-step-<k>`` in it, plus one), so an episode survives its history being
compacted: the summary it writes names the last step done. Around the steps, as a model does
them and each harness answers them:

* a compaction request (each harness's own summary prompt: ``SUMMARY_MARKERS``) gets a summary:
  ``<analysis>`` then ``<summary>`` (Claude Code asks again without one) holding a
  ``<state_snapshot>`` (Qwen Code rejects a summary without it);
* Gemini CLI's next-speaker check and its loop check (after 30 turns) get their JSON
  (``next_speaker: model``; no loop);
* a side call without tools (a title) gets a title;
* ``subagent_at``: at that step the main loop calls the harness's subagent tool (Claude Code's
  ``Agent``, Qwen Code's ``agent``, Gemini CLI's ``invoke_agent``, OpenCode's ``task``); the
  subagent runs one shell step and answers;
* ``parallel_at``: at that step two shell calls in one reply;
* ``retry_at``: at that step the episode's first request gets an empty reply (an untrained model's
  immediate end of turn), which the harness may send again (Claude Code and Qwen Code do; the
  others end their run on it);
* ``pause_at``: at that step a reply without a call that says what comes next (Gemini CLI, with
  its next-speaker check on, continues with "Please continue."; the others end the run).

:func:`compaction_instance` is the instance part that makes a preset compact once its context
passes about N tokens, through the harness's own setting (docs/HARNESS.md, "compaction"), and
``COMPACT_AFTER`` how far past a preset's first prompt to put N so that it compacts a few steps in,
and not again at once after it (the compacted history's own size).
"""
from __future__ import annotations

import hashlib
import json
import re
import threading
from typing import Any

from rolloutd.backends.policies import Policy, PolicyReply, PolicyRequest

__all__ = ["COMPACT_AFTER", "EpisodePolicy", "episode_tag", "SUMMARY_MARKERS", "SUBAGENT_TOOLS", "STEP",
           "compaction_instance",
           "episode_task"]

STEP = "rolloutd-step-"
_STEP_RE = re.compile(re.escape(STEP) + r"(\d+)")
_SUBTASK = "Subtask rolloutd-sub:"
_SUB_DONE = "rolloutd-sub-ok"
_PAUSED = "rolloutd-paused"
# Each harness's compaction prompt, as it reaches the template (the last user message or the
# system prompt): Codex, Claude Code, Qwen Code (its forked and cold requests), Gemini CLI
# (summary, verification, its experimental history provider), OpenCode, Pi.
SUMMARY_MARKERS = ("CONTEXT CHECKPOINT COMPACTION", "Respond with TEXT ONLY",
                   "component that summarizes a conversation",
                   "Then, produce the <state_snapshot>", "generate the updated <state_snapshot>",
                   "Critically evaluate the <state_snapshot>", "State Update: Agent Continuity",
                   "context summarization agent", "context summarization assistant")
_NEXT_SPEAKER = "who should logically speak next"
_LOOP_CHECK = "stuck in a repetitive, non-productive state"  # Gemini CLI's loop check, after 30 turns
# The subagent tool of each harness and the arguments that name the kind of agent.
SUBAGENT_TOOLS = {"Agent": {"subagent_type": "general-purpose"}, "agent": {"subagent_type": "general-purpose"},
                  "invoke_agent": {"agent_name": "generalist"}, "task": {"subagent_type": "general"}}
_BLOCK = re.compile(r"<\|im_start\|>(\w+)\n")
_KNOBS = ("steps", "subagent_at", "parallel_at", "retry_at", "pause_at", "nonce")  # nonce: tells episodes apart
_TAG_RE = re.compile(r"\[episode((?: \w+=\d+)*)\]")


def episode_tag(task: str) -> str:
    """The ``[episode ...]`` tag of a task text (the key of ``EpisodePolicy.episodes``)."""
    m = _TAG_RE.search(task)
    return m.group(0) if m else ""


def episode_task(steps: int, **knobs: int | None) -> str:
    """A task text whose tag tells :class:`EpisodePolicy` what this job's episode is (so one backend
    serves jobs of every kind at once): ``[episode steps=10 pause_at=5]`` (``_KNOBS``)."""
    bad = set(knobs) - set(_KNOBS)
    if bad:
        raise ValueError(f"unknown episode knobs {sorted(bad)}; known: {_KNOBS}")
    tag = " ".join(f"{k}={int(v)}" for k, v in dict(knobs, steps=steps).items() if v is not None)
    return f"Benchmark: follow the instructions. [episode {tag}]"


def _blocks(text: str) -> list[tuple[str, str]]:
    """(role, text) of each ChatML block of a rendered prompt."""
    heads = list(_BLOCK.finditer(text))
    return [(m.group(1), text[m.end():(heads[i + 1].start() if i + 1 < len(heads) else len(text))])
            for i, m in enumerate(heads)]


def _role_of_first(blocks: list[tuple[str, str]], needle: str) -> str | None:
    return next((role for role, body in blocks if needle in body), None)


def _filled_call(tool: dict, args: dict) -> str:
    """A hermes call of ``tool`` with ``args`` it has and every other required argument filled."""
    from rolloutd.handlers.oracles import _call

    def fill(schema: dict, given: dict | None = None) -> Any:
        typ = schema.get("type")
        if typ == "object" or "properties" in schema:
            props = schema.get("properties") or {}
            out = {a: v for a, v in (given or {}).items() if a in props}
            for req in schema.get("required") or []:
                if req not in out:
                    out[req] = fill(props.get(req) or {})
            return out
        return {"boolean": False, "integer": 1, "number": 1, "array": []}.get(typ, "Subtask finished.")

    return _call(tool["name"], fill(tool["parameters"] or {}, args))


class EpisodePolicy(Policy):
    """``steps`` echo steps through the harness's shell tool, then a final answer (module doc). The
    task's ``[episode ...]`` tag (:func:`episode_task`), when the prompt has one, overrides the
    constructor's knobs for that job."""

    name = "episode"

    def __init__(self, steps: int = 10, *, subagent_at: int | None = None, parallel_at: int | None = None,
                 retry_at: int | None = None, pause_at: int | None = None, **options: Any) -> None:
        super().__init__(**options)
        self.steps = int(steps)
        self.subagent_at, self.parallel_at, self.retry_at, self.pause_at = subagent_at, parallel_at, retry_at, pause_at
        self.nonce = None
        self._seen: set[bytes] = set()  # episodes (or prompts) that got their empty reply
        self._lock = threading.Lock()
        self.kinds: dict[str, int] = {}  # what it answered, by kind (tests read it)
        self.episodes: dict[str, dict[str, int]] = {}  # the same per episode tag ("" without one)
        self._tag = threading.local()

    def _count(self, kind: str) -> None:
        with self._lock:
            self.kinds[kind] = self.kinds.get(kind, 0) + 1
            per = self.episodes.setdefault(getattr(self._tag, "key", ""), {})
            per[kind] = per.get(kind, 0) + 1

    def reply(self, request: PolicyRequest) -> str | PolicyReply:
        from rolloutd.handlers.harness_presets import TITLE_REPLY, offered_tools, shell_call

        text = request.prompt_text
        tag = _TAG_RE.search(text)
        self._tag.key = tag.group(0) if tag is not None else ""
        knobs = {k: getattr(self, k) for k in _KNOBS}
        if tag is not None:  # this job's episode (the task text, or a summary that carried it on)
            knobs.update((k, int(v)) for k, v in (kv.split("=") for kv in tag.group(1).split()) if k in knobs)
        steps, retry_at, pause_at = knobs["steps"], knobs["retry_at"], knobs["pause_at"]
        blocks = _blocks(text)
        users = [body for role, body in blocks if role == "user"]
        last_user = users[-1] if users else ""
        system = next((body for role, body in blocks if role == "system"), "")
        done = [int(x) for x in _STEP_RE.findall(text)]
        k = max(done) + 1 if done else 0
        if _NEXT_SPEAKER in last_user:
            self._count("next_speaker")
            nxt = "model" if k < steps else "user"
            return json.dumps({"reasoning": "The last response says what the model does next.", "next_speaker": nxt})
        if _LOOP_CHECK in last_user:
            self._count("loop_check")
            return json.dumps({"unproductive_state_analysis": "Each step runs a new command: progress.",
                               "unproductive_state_confidence": 0.0})
        if any(m in last_user or m in system for m in SUMMARY_MARKERS):
            self._count("summary")
            notes = "".join(f" {m}." for m in (_PAUSED, "rolloutd-spawned") if m in text)
            notes += f" {tag.group(0)}" if tag is not None else ""
            last = f"{STEP}{k - 1}" if k else "no step yet"
            return (f"<analysis>\nThe steps run so far.\n</analysis>\n<summary>\n<state_snapshot>\nCheckpoint: done "
                    f"through {last}.{notes}\n</state_snapshot>\n</summary>")
        tools = offered_tools(text)
        if not tools:
            self._count("title")
            return TITLE_REPLY
        if _role_of_first(blocks, _SUBTASK) == "user":  # a subagent's own conversation
            if _SUB_DONE in "".join(body for role, body in blocks if role == "user" and _SUBTASK not in body):
                self._count("subagent_final")
                done = next((t for t in tools if t["name"] == "complete_task"), None)  # Gemini CLI's subagents end so
                return "Subtask finished." + ("\n" + _filled_call(done, {}) if done is not None else "")
            self._count("subagent_step")
            return "Running the subtask.\n" + (shell_call(tools, f"echo {_SUB_DONE}", "subtask") or "")
        if k >= steps:
            self._count("final")
            return "All steps done."
        if retry_at == k:
            # once per episode (its tag, nonce included; else this prompt): a harness may retry with an
            # edited request, which must get the step
            key = hashlib.sha256((tag.group(0) if tag is not None else repr(request.prompt_ids)).encode()).digest()
            with self._lock:
                first = key not in self._seen
                self._seen.add(key)
            if first:
                self._count("empty")
                return PolicyReply(text="")
        if pause_at == k and _PAUSED not in text:
            self._count("pause")
            return f"Next, I will run the next step ({_PAUSED})."
        if knobs["subagent_at"] == k and "rolloutd-spawned" not in text:
            tool = next((t for t in tools if t["name"] in SUBAGENT_TOOLS), None)
            if tool is not None:
                self._count("spawn")
                mark = f"(rolloutd-spawned {STEP}{k})"  # in the main's history from here on
                args = {"description": f"Subtask {mark}", **SUBAGENT_TOOLS[tool["name"]],
                        "prompt": f"{_SUBTASK} run `echo {_SUB_DONE}` with your shell tool, then answer in one line. "
                                  f"{mark}"}
                return f"Delegating step {k}.\n" + _filled_call(tool, args)
        self._count("step")
        call = shell_call(tools, f"echo {STEP}{k}", f"step {k}") or ""
        if knobs["parallel_at"] == k:
            call += "\n" + (shell_call(tools, f"echo {STEP}{k} again", f"step {k} again") or "")
        return f"Step {k}.\n" + call


# -- compaction: each harness's own setting --------------------------------------------------
# Tokens past the preset's first prompt (tiny vocabulary: its steps take 60-150 tokens each) where
# compaction sets in: Claude Code's compacted history is ~400-650 tokens over its first prompt and
# stops with "Autocompact is thrashing" when that passes the threshold at once; Pi's is where the
# window itself ends (it compacts on an overflow).
COMPACT_AFTER = {"codex": 600, "claude-code": 1000, "opencode": 450, "pi": 380, "qwen-code": 480, "gemini-cli": 350}

# Gemini CLI applies its threshold to its own token limit for a model name it does not know.
GEMINI_TOKEN_LIMIT = 1_048_576
# Qwen Code's window for the threshold: large enough that its fraction, not the window's
# reserves (20,000 for the summary, 13,000 of buffer), sets the trigger.
QWEN_WINDOW = 200_000


def compaction_instance(preset: str, at: int) -> dict:
    """The instance keys that make ``preset`` compact its history once its context passes about
    ``at`` tokens, each harness through its own setting (merged over the preset's files):

    * codex: ``model_auto_compact_token_limit`` in ``config.toml``;
    * claude-code: ``CLAUDE_CODE_AUTO_COMPACT_WINDOW`` with ``CLAUDE_AUTOCOMPACT_PCT_OVERRIDE=50``;
    * opencode: the model's ``limit`` (context = ``at`` + output 1024; it compacts at context - output);
    * pi: the model's ``contextWindow`` and ``limits.max_context`` (pi compacts mid-run only when a
      request overflows: the endpoint's 400 in vLLM's words), ``compaction.keepRecentTokens`` 40;
    * qwen-code: ``context.autoCompactThreshold`` of ``model.generationConfig.contextWindowSize``;
    * gemini-cli: ``model.compressionThreshold`` (a fraction of its 1,048,576-token limit) with
      ``model.skipNextSpeakerCheck: false``: its compression splits the history at a user message
      that is not a tool result, which a headless run only has after a "Please continue." (the
      episode needs a pause, ``EpisodePolicy(pause_at=...)``).
    """
    from rolloutd.handlers.harness_presets import PRESETS

    files = PRESETS[preset]["home_files"]
    if preset == "codex":
        path = ".codex/config.toml"
        return {"home_files": {path: f"model_auto_compact_token_limit = {at}\n" + files[path]}}
    if preset == "claude-code":
        return {"env": {"CLAUDE_CODE_AUTO_COMPACT_WINDOW": str(2 * at + 20_000),
                        "CLAUDE_AUTOCOMPACT_PCT_OVERRIDE": "50"}}
    if preset == "opencode":
        path = ".config/opencode/opencode.json"
        cfg = json.loads(files[path])
        cfg["provider"]["rolloutd"]["models"]["{model}"]["limit"] = {"context": at + 1024, "output": 1024}
        return {"home_files": {path: json.dumps(cfg)}}
    if preset == "pi":
        path = ".pi/agent/models.json"
        cfg = json.loads(files[path])
        cfg["providers"]["rolloutd"]["models"][0]["contextWindow"] = at
        # it keeps the last keepRecentTokens of messages verbatim (default 20,000, its estimate: 4
        # characters a token; the system prompt and tools not counted): 40, so there is history to summarise
        keep = {"compaction": {"keepRecentTokens": 40}}
        return {"home_files": {path: json.dumps(cfg), ".pi/agent/settings.json": json.dumps(keep)},
                "limits": {"max_context": at}}
    if preset == "qwen-code":
        path = ".qwen/settings.json"
        cfg = json.loads(files[path])
        cfg.setdefault("context", {})["autoCompactThreshold"] = round(at / QWEN_WINDOW, 6)
        cfg["model"]["generationConfig"] = {"contextWindowSize": QWEN_WINDOW}
        return {"home_files": {path: json.dumps(cfg)}}
    if preset == "gemini-cli":
        path = ".gemini/settings.json"
        cfg = json.loads(files[path])
        cfg.setdefault("model", {}).update(compressionThreshold=round(at / GEMINI_TOKEN_LIMIT, 6),
                                           skipNextSpeakerCheck=False)
        return {"home_files": {path: json.dumps(cfg)}}
    raise ValueError(f"no compaction setting known for preset {preset!r}")
