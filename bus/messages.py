"""Typed wire messages and the protocol version.

Every message header is a msgpack map with ``v`` (protocol version) and ``kind``; the
remaining keys are the fields of the dataclass registered for that kind. Unknown keys
are tolerated (a newer peer may add fields); missing required keys and wrong types are
rejected with a ``MessageError`` carrying a wire error code. An import-time check makes
sure every message class follows the convention.
"""
from __future__ import annotations

import dataclasses
import typing
from typing import Any, ClassVar, Optional

import numpy as np

PROTOCOL_VERSION = 1

STATUSES = ("ok", "failed", "timeout", "cancelled")
PHASES = ("queue", "init", "run", "eval")


class MessageError(ValueError):
    """A message that cannot be accepted; ``code`` is one of ERROR_CODES."""

    def __init__(self, code: str, message: str):
        super().__init__(message)
        self.code = code
        self.message = message


# Error codes a reply can carry; docs/PROTOCOL.md lists them with their meaning.
ERROR_CODES = {
    "malformed": "frames do not decode (not msgpack, bad array frame, header not a map)",
    "bad_version": "protocol version missing or not supported",
    "unknown_kind": "no message of that kind",
    "invalid": "a field is missing or has the wrong type or value",
    "too_large": "the request exceeds the size limit",
    "unknown_handler": "no handler registered under that name",
    "not_found": "no such job",
    "already_finished": "the job already has a result",
    "unavailable": "the service cannot do that now (no router, draining)",
    "internal": "an unexpected error in the service; the request was not applied",
}

REGISTRY: dict[str, type] = {}


def message(kind: str):
    """Register a dataclass as the message of ``kind``."""

    def wrap(cls):
        cls = dataclasses.dataclass(cls)
        cls.KIND = kind
        if kind in REGISTRY:
            raise TypeError(f"message kind {kind!r} registered twice")
        REGISTRY[kind] = cls
        cls._hints = typing.get_type_hints(cls)
        # (name, checker, required) per field, compiled once: from_wire runs on every hop of
        # every job, and typing introspection per field per message cost ~1 us each.
        cls._fields = [(f.name, _compile(cls._hints[f.name]),
                        f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                       for f in dataclasses.fields(cls)]
        return cls

    return wrap


class Message:
    KIND: ClassVar[str]

    def to_wire(self) -> dict:
        d = {"v": PROTOCOL_VERSION, "kind": self.KIND}
        for f in dataclasses.fields(self):
            d[f.name] = getattr(self, f.name)
        return d


def from_wire(d: dict, expect: tuple[str, ...] | None = None) -> Message:
    """Validate a decoded header and build its message object."""
    v = d.get("v")
    if v != PROTOCOL_VERSION:
        raise MessageError("bad_version", f"protocol version {v!r} not supported (this side speaks {PROTOCOL_VERSION})")
    kind = d.get("kind")
    cls = REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None or (expect is not None and kind not in expect):
        raise MessageError("unknown_kind", f"unknown message kind {kind!r}")
    kwargs = {}
    for name, check, required in cls._fields:
        if name in d:
            val = d[name]
            if not check(val):
                raise MessageError("invalid", f"{kind}.{name}: expected {_tname(cls._hints[name])}, got {type(val).__name__}")
            kwargs[name] = val
        elif required:
            raise MessageError("invalid", f"{kind}: field {name!r} is required")
    msg = cls(**kwargs)
    validate = getattr(msg, "validate", None)
    if validate is not None:
        validate()
    return msg


def _compile(hint):
    """A one-argument checker: does ``val`` (as msgpack decoded it) fit the type hint? bool is not
    an int here, a tuple hint takes a list, dict hints check only the container."""
    origin = typing.get_origin(hint)
    if hint is Any:
        return lambda val: True
    if origin is typing.Union:
        args = typing.get_args(hint)
        if len(args) == 2 and type(None) in args:
            inner = _compile(args[0] if args[1] is type(None) else args[1])
            return lambda val: val is None or inner(val)
        checks = [_compile(h) for h in args]
        return lambda val: any(c(val) for c in checks)
    if hint is type(None):
        return lambda val: val is None
    if hint is float:
        return lambda val: val.__class__ is float or (isinstance(val, (int, float)) and not isinstance(val, bool))
    if hint is int:
        return lambda val: val.__class__ is int or (isinstance(val, int) and not isinstance(val, bool))
    if origin in (list, tuple):
        args = typing.get_args(hint)
        if not args:
            return lambda val: isinstance(val, list)
        inner = _compile(args[0])
        return lambda val: isinstance(val, list) and all(inner(x) for x in val)
    if origin is dict:
        return lambda val: isinstance(val, dict)
    return lambda val: isinstance(val, hint)


def _tname(hint) -> str:
    return getattr(hint, "__name__", None) or str(hint).replace("typing.", "")


def _positive(name: str, val, allow_zero=True):
    if val is not None and (val < 0 or (not allow_zero and val == 0)):
        raise MessageError("invalid", f"{name} must be {'>= 0' if allow_zero else '> 0'}")


# ---- trainer <-> gateway ------------------------------------------------------------
@message("submit")
class Submit(Message):
    """A batch of task instances; each is run ``n`` times (one job per sample)."""

    tasks: list[dict]
    client_id: str = ""
    idempotency_key: Optional[str] = None
    req_id: int = 0

    def validate(self):
        if not self.tasks:
            raise MessageError("invalid", "submit.tasks is empty")
        for i, t in enumerate(self.tasks):
            if not isinstance(t.get("handler"), str):
                raise MessageError("invalid", f"tasks[{i}].handler must be a string")
            if not isinstance(t.get("instance", {}), dict):
                raise MessageError("invalid", f"tasks[{i}].instance must be a map")
            n = t.get("n", 1)
            if not isinstance(n, int) or isinstance(n, bool) or not 1 <= n <= 4096:
                raise MessageError("invalid", f"tasks[{i}].n must be an integer in 1..4096")
            for key in ("timeout_s",):
                v = t.get(key)
                if v is not None and (not isinstance(v, (int, float)) or v <= 0):
                    raise MessageError("invalid", f"tasks[{i}].{key} must be a positive number")


@message("poll")
class Poll(Message):
    """Results with sequence number > ``after``; everything <= ``after`` is acknowledged."""

    client_id: str = ""
    after: int = 0
    max_results: int = 256
    wait_s: float = 0.0
    req_id: int = 0

    def validate(self):
        _positive("after", self.after)
        _positive("max_results", self.max_results, allow_zero=False)
        if not 0 <= self.wait_s <= 300:
            raise MessageError("invalid", "wait_s must be within 0..300")


@message("cancel")
class Cancel(Message):
    job_ids: list[int]
    req_id: int = 0


@message("status")
class Status(Message):
    req_id: int = 0


@message("add_llm_server")
class AddLLMServer(Message):
    address: str
    api: str = "vllm"
    policy_version: int = 0
    capacity: int = 0
    weight: float = 1.0
    node: str = ""
    req_id: int = 0

    def validate(self):
        if self.api not in ("vllm", "sglang"):
            raise MessageError("invalid", f"api must be 'vllm' or 'sglang', not {self.api!r}")
        if not self.address.startswith(("http://", "https://")):
            raise MessageError("invalid", "address must be an http(s) URL")
        _positive("capacity", self.capacity)
        _positive("weight", self.weight, allow_zero=False)


@message("clear_llm_server")
class ClearLLMServer(Message):
    address: Optional[str] = None  # None clears every backend
    req_id: int = 0


@message("list_llm_servers")
class ListLLMServers(Message):
    req_id: int = 0


@message("start")
class Start(Message):
    """Resume dispatching queued jobs."""

    req_id: int = 0


@message("stop")
class Stop(Message):
    """Pause dispatching: queued jobs stay queued, jobs in flight finish."""

    req_id: int = 0


@message("reply")
class Reply(Message):
    req_id: int = 0
    body: dict = dataclasses.field(default_factory=dict)


@message("error")
class Error(Message):
    code: str
    message: str
    req_id: int = 0


CLIENT_REQUESTS = ("submit", "poll", "cancel", "status", "add_llm_server", "clear_llm_server",
                   "list_llm_servers", "start", "stop")


# ---- pipeline: gateway -> init -> run -> eval -> gateway --------------------------------
@message("job")
class Job(Message):
    """One sample of one instance, travelling through the phases with its state."""

    job_id: int
    attempt: int
    handler: str
    instance: dict
    instance_id: str = ""
    sample_index: int = 0
    client_id: str = ""
    budget_s: Optional[float] = None      # counts only init+run+eval time
    phase_limits: dict = dataclasses.field(default_factory=dict)
    spent_s: float = 0.0                  # budget used so far
    timing: dict = dataclasses.field(default_factory=dict)
    state: dict = dataclasses.field(default_factory=dict)      # handler-owned, serializable
    sandbox: Optional[dict] = None        # SandboxHandle.to_dict()
    trajectory: dict = dataclasses.field(default_factory=dict)  # partial result fields
    node: str = ""
    sent_at: float = 0.0                  # wall clock at the last hand-off, for queue time


@message("result")
class Result(Message):
    job_id: int
    attempt: int
    trajectory: dict
    node: str = ""
    requeue: bool = False   # not a result: run the job again (a stale policy under abort_requeue)


# ---- run daemon / gateway <-> router -------------------------------------------------
@message("lease")
class Lease(Message):
    job_id: int
    requester: str = ""
    node: str = ""
    exclude: list[str] = dataclasses.field(default_factory=list)  # backend ids that failed this job
    wait_s: float = 10.0
    req_id: int = 0


@message("release")
class Release(Message):
    lease_id: str
    req_id: int = 0


@message("backend_failed")
class BackendFailed(Message):
    lease_id: str
    backend_id: str
    error: str = ""
    req_id: int = 0


# ---- trajectory (what a trainer gets back) -------------------------------------------
def empty_trajectory(job_id: int = 0, instance_id: str = "", sample_index: int = 0) -> dict:
    """The trajectory shape of the design; every result carries every key."""
    return {
        "job_id": job_id,
        "instance_id": instance_id,
        "sample_index": sample_index,
        "handler": "",
        "status": "ok",
        "failed_phase": None,
        "error": None,
        "reward": 0.0,
        "eval_details": {},
        "prompt_ids": np.zeros(0, np.int32),
        "response_ids": np.zeros(0, np.int32),
        "loss_mask": np.zeros(0, np.int8),
        "logprobs": np.zeros(0, np.float32),
        "turns": [],
        "metrics": {},
        "timing": {},
        "attempts": 1,
        "policy_version": None,
        "stale": False,
        "node": "",
    }


def _convention_check():
    for kind, cls in REGISTRY.items():
        if cls.KIND != kind or not issubclass(cls, Message):
            raise TypeError(f"message {cls.__name__} breaks the convention")
        names = [f.name for f in dataclasses.fields(cls)]
        if "v" in names or "kind" in names:
            raise TypeError(f"message {cls.__name__} shadows a header key")


_convention_check()
