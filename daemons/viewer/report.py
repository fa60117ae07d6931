"""Results JSONL -> the data a viewer page shows.

The JSONL is streamed: one line at a time becomes a small overview row (kept) and a detail
record (written out at once, never kept), so a 10,000-trajectory file costs the memory of its
rows plus the token vocabulary it uses. Token ids stay ids in the detail records; the page maps
them to text through one table of the pieces this file uses (``vocab``), so each piece is
decoded once per file, not once per token.

What a detail record holds (all lists, JSON-ready): the result's own fields (ids, mask,
logprobs rounded to 4 places, turns, segments, timing, metrics, error, eval details, reward),
plus ``noncanonical``: per segment, the positions of sampled tokens whose ids differ from what
the tokenizer makes of their decoded text (a non-canonical split the trainer trains on as
sampled; shown, never "fixed").
"""
from __future__ import annotations

import difflib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

PHASES = ("queue", "init", "run", "eval")
MAX_TEXT = 20_000  # characters kept of any one string in eval details / errors


def read_results(path: str | Path) -> Iterator[tuple[int, dict]]:
    """(line number, result) per non-empty line; a line that is not a JSON object is reported
    as a row of status ``unreadable`` rather than stopping the whole report."""
    with open(path, encoding="utf-8") as f:
        for n, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                r = json.loads(line)
            except json.JSONDecodeError as e:
                r = {"status": "unreadable", "error": {"type": "JSONDecodeError", "message": f"line {n}: {e}"}}
            if not isinstance(r, dict):
                r = {"status": "unreadable", "error": {"type": "TypeError", "message": f"line {n}: not an object"}}
            yield n, r


def _ints(v: Any) -> list[int]:
    if not isinstance(v, list):
        return []
    return [int(x) for x in v if isinstance(x, (int, float)) and not isinstance(x, bool)]


def _floats(v: Any) -> list[float | None]:
    if not isinstance(v, list):
        return []
    out: list[float | None] = []
    for x in v:
        out.append(round(float(x), 4) if isinstance(x, (int, float)) and math.isfinite(x) else None)
    return out


def _clip(v: Any) -> Any:
    """Long strings cut (a test log can be megabytes); structure kept."""
    if isinstance(v, str):
        return v if len(v) <= MAX_TEXT else v[: MAX_TEXT // 2] + f"\n[... {len(v) - MAX_TEXT} characters cut ...]\n" + v[-MAX_TEXT // 2:]
    if isinstance(v, dict):
        return {str(k): _clip(x) for k, x in v.items()}
    if isinstance(v, list):
        return [_clip(x) for x in v]
    if isinstance(v, float) and not math.isfinite(v):
        return str(v)
    return v


def _segments(r: dict) -> list[dict]:
    """Every segment of the result: harness episodes list them in ``segments`` (the top level is
    the last one); everything else is one segment, the top level."""
    segs = r.get("segments")
    if isinstance(segs, list) and segs:
        return [s for s in segs if isinstance(s, dict)]
    return [r]


@dataclass
class Row:
    """One trajectory in the overview (small: no tokens)."""
    i: int
    job_id: Any
    instance_id: str
    sample_index: Any
    handler: str
    status: str
    failed_phase: str | None
    error_type: str | None
    reward: float | None
    turns: int
    sampled: int
    attempts: Any
    policy_version: Any
    timing: dict
    segments: int

    def to_json(self) -> dict:
        return self.__dict__


@dataclass
class Canon:
    """Finds non-canonical splits: sampled ids that differ from the encoding of their text."""
    tok: Any

    def positions(self, ids: list[int]) -> list[int]:
        if not ids:
            return []
        text = self.tok.decode(ids, skip_special_tokens=False, clean_up_tokenization_spaces=False)
        canon = self.tok.encode(text, add_special_tokens=False)
        if canon == ids:
            return []
        sm = difflib.SequenceMatcher(a=ids, b=canon, autojunk=False)
        out: list[int] = []
        for op, a0, a1, _, _ in sm.get_opcodes():
            if op != "equal":
                out.extend(range(a0, a1))
        return out


def detail(r: dict, canon: Canon | None) -> dict:
    """What the trajectory page needs, JSON-ready."""
    segs = []
    for s in _segments(r):
        resp = _ints(s.get("response_ids"))
        mask = _ints(s.get("loss_mask"))
        turns = [t for t in s.get("turns") or [] if isinstance(t, dict)]
        nc: list[int] = []
        if canon is not None:
            for t in turns:
                span = t.get("span") or [t.get("start"), t.get("end")]
                try:
                    a, b = int(span[0]), int(span[1])
                except (TypeError, ValueError, IndexError):
                    continue
                nc.extend(a + p for p in canon.positions(resp[a:b]))
        segs.append({"prompt_ids": _ints(s.get("prompt_ids")), "response_ids": resp, "loss_mask": mask,
                     "logprobs": _floats(s.get("logprobs")), "turns": _clip(turns), "noncanonical": nc})
    keep = ("job_id", "instance_id", "sample_index", "handler", "status", "failed_phase", "error", "reward",
            "eval_details", "timing", "metrics", "attempts", "policy_version", "stale", "node")
    out = {k: _clip(r.get(k)) for k in keep}
    out["segments"] = segs
    return out


def row(i: int, r: dict, d: dict) -> Row:
    """The overview row of result ``r`` whose detail record is ``d``."""
    segs = _segments(r)
    sampled = sum(s["loss_mask"].count(1) for s in d["segments"])
    err = r.get("error") if isinstance(r.get("error"), dict) else None
    reward = r.get("reward")
    timing = r.get("timing") if isinstance(r.get("timing"), dict) else {}
    return Row(i=i, job_id=r.get("job_id"), instance_id=str(r.get("instance_id", "")),
               sample_index=r.get("sample_index"), handler=str(r.get("handler", "")),
               status=str(r.get("status", "")), failed_phase=r.get("failed_phase"),
               error_type=(err or {}).get("type"),
               reward=float(reward) if isinstance(reward, (int, float)) and math.isfinite(reward) else None,
               turns=sum(len(s.get("turns") or []) for s in segs), sampled=sampled,
               attempts=r.get("attempts"), policy_version=r.get("policy_version"),
               timing={k: round(float(timing[k]), 4) for k in PHASES
                       if isinstance(timing.get(k), (int, float)) and math.isfinite(timing[k])},
               segments=len(segs))


def used_ids(d: dict) -> set[int]:
    ids: set[int] = set()
    for s in d["segments"]:
        ids.update(s["prompt_ids"])
        ids.update(s["response_ids"])
    return ids


def vocab(tok: Any, ids: set[int]) -> dict[str, str]:
    """id -> its text as the page shows it (one decode per distinct id)."""
    out = {}
    for i in sorted(ids):
        try:
            out[str(i)] = tok.decode([i], skip_special_tokens=False, clean_up_tokenization_spaces=False)
        except Exception:  # noqa: BLE001 - an id outside the vocabulary shows as its number
            out[str(i)] = f"<{i}>"
    return out


def summarize(rows: list[Row]) -> dict:
    """Batch overview: reward by domain and by group, statuses and failure phases, mean phase times."""
    by_status: dict[str, int] = {}
    failed_at: dict[str, int] = {}
    dom: dict[str, list] = {}
    groups: dict[str, list] = {}
    phase_sum = dict.fromkeys(PHASES, 0.0)
    phase_n = dict.fromkeys(PHASES, 0)
    for r in rows:
        by_status[r.status] = by_status.get(r.status, 0) + 1
        if r.status != "ok":
            key = f"{r.status}@{r.failed_phase or '-'}"
            failed_at[key] = failed_at.get(key, 0) + 1
        d = dom.setdefault(r.handler, [0, 0, 0.0])  # jobs, ok with reward, reward sum
        d[0] += 1
        if r.status == "ok" and r.reward is not None:
            d[1] += 1
            d[2] += r.reward
            groups.setdefault(r.instance_id, []).append(r.reward)
        for k, v in r.timing.items():
            phase_sum[k] += v
            phase_n[k] += 1
    group_rows = []
    for gid, rs in groups.items():
        mean = sum(rs) / len(rs)
        var = sum((x - mean) ** 2 for x in rs) / len(rs)
        group_rows.append({"group": gid, "n": len(rs), "mean": round(mean, 4), "std": round(math.sqrt(var), 4),
                           "zero_variance": len(rs) > 1 and var == 0.0})
    return {"jobs": len(rows), "by_status": by_status, "failed_at": failed_at,
            "domains": [{"handler": h, "jobs": v[0], "scored": v[1],
                         "mean_reward": round(v[2] / v[1], 4) if v[1] else None} for h, v in sorted(dom.items())],
            "groups": sorted(group_rows, key=lambda g: g["group"]),
            "phase_mean_s": {k: round(phase_sum[k] / phase_n[k], 4) if phase_n[k] else None for k in PHASES}}
