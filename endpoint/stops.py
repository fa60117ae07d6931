"""Stop strings and token text: what the endpoint decodes from sampled ids (never the backend's text)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import numpy as np

from ..llm.client import Generation


def apply_stop(g: Generation, text: str, stops: list[str], before: str,
               decode: Callable[[Any], str]) -> tuple[str, str | None]:
    """Cut the generation after the token that completes the first stop string (OpenAI's
    ``stop``; the tokens after it are dropped, so the trajectory holds what the agent saw);
    returns the text before the stop string and the stop string (None when none occurs).
    ``before``: this message's earlier parts; ``decode``: ids to text (:meth:`TokenText.decode`)."""
    full = before + text
    hits = [(i, s) for s in stops if (i := full.find(s, max(0, len(before) - len(s) + 1))) >= 0]
    if not hits:
        return text, None
    cut, stop = min(hits)
    ids = np.asarray(g.token_ids).tolist()
    lo, hi = 1, len(ids)  # the shortest prefix whose text contains the stop string
    while lo < hi:
        mid = (lo + hi) // 2
        if stop in before + decode(ids[:mid]):
            hi = mid
        else:
            lo = mid + 1
    g.token_ids = np.asarray(ids[:lo], dtype=np.int32)
    g.logprobs = np.asarray(g.logprobs)[:lo]
    g.finish_reason = "stop"
    return (full[len(before):cut] if cut >= len(before) else ""), stop


class TokenText:
    """Text of sampled ids with one tokenizer; single-token strings cached (logprobs' ``token``)."""

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._decode_cache: dict[int, str] = {}

    def decode(self, ids: Any) -> str:
        return self.tokenizer.decode(np.asarray(ids).tolist(), skip_special_tokens=True)

    def token_strs(self, ids: list[int]) -> list[str]:
        cache = self._decode_cache
        out = []
        for t in ids:
            s = cache.get(t)
            if s is None:
                s = cache[t] = self.tokenizer.decode([t], skip_special_tokens=False)
            out.append(s)
        return out
