"""Typed wire messages and the protocol version.

Every message header is a msgpack map with ``v`` (protocol version, an int) and ``kind``;
the remaining keys are the fields of the dataclass registered for that kind. A field without
a default is required; a field with one is optional and takes that default when absent (docs/
PROTOCOL.md lists them). Unknown keys are tolerated (a newer peer may add fields); missing
required keys and wrong types are rejected with a ``MessageError`` carrying a wire error code
and a text that names the field, the expected type and what came instead. A submit's tasks
are checked the same way against ``Task``. An import-time check makes sure every message
class follows the convention.
"""
from __future__ import annotations

import dataclasses
import math
import typing
from urllib.parse import urlsplit
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
    "journal_full": "the gateway cannot write its journal (disk full); nothing was applied, retry later",
    "internal": "an unexpected error in the service; the request was not applied",
}

REGISTRY: dict[str, type] = {}


def schema(cls):
    """A dataclass whose instances are checked field by field from a decoded map."""
    cls = dataclasses.dataclass(cls)
    cls._hints = typing.get_type_hints(cls)
    # (name, checker, required) per field, compiled once: from_wire runs on every hop of
    # every job, and typing introspection per field per message cost ~1 us each.
    cls._fields = [(f.name, _compile(cls._hints[f.name]),
                    f.default is dataclasses.MISSING and f.default_factory is dataclasses.MISSING)
                   for f in dataclasses.fields(cls)]
    return cls


def message(kind: str):
    """Register a dataclass as the message of ``kind``."""

    def wrap(cls):
        cls = schema(cls)
        cls.KIND = kind
        if kind in REGISTRY:
            raise TypeError(f"message kind {kind!r} registered twice")
        REGISTRY[kind] = cls
        return cls

    return wrap


def check_fields(cls, d: dict, where) -> dict:
    """The fields of ``cls`` found in ``d``, each checked against its type; raises ``invalid``
    for a missing required field or a wrong type. ``where`` (a string, or a function making one:
    only an error needs it) prefixes the error text."""
    kwargs = {}
    for name, check, required in cls._fields:
        if name in d:
            val = d[name]
            if not check(val):
                hint = cls._hints[name]
                raise MessageError("invalid", f"{_where(where)}.{name}: expected {_tname(hint)}, got {_why(hint, val)}")
            kwargs[name] = val
        elif required:
            raise MessageError("invalid", f"{_where(where)}.{name} is required ({_tname(cls._hints[name])})")
    return kwargs


def _where(where) -> str:
    return where() if callable(where) else where


class Message:
    KIND: ClassVar[str]

    def to_wire(self) -> dict:
        # req_id ahead of the other fields: a request refused before it is decoded whole (too
        # many values) still gets its req_id back, read from the first entries (codec.peek_req_id).
        d = {"v": PROTOCOL_VERSION, "kind": self.KIND}
        if hasattr(self, "req_id"):
            d["req_id"] = self.req_id
        for name, _check, _required in self._fields:  # dataclasses.fields() per call: ~1 us
            d[name] = getattr(self, name)
        return d


def from_wire(d: dict, expect: tuple[str, ...] | None = None, head_only: bool = False) -> Message:
    """Validate a decoded header and build its message object. ``head_only``: a message with a
    ``validate_head`` (submit) runs only that; the caller checks the rest in slices."""
    v = d.get("v")
    if v.__class__ is not int or v != PROTOCOL_VERSION:  # 1.0 and true compare equal to 1: not versions
        got = "missing" if "v" not in d else f"{v!r} ({_vname(v)})"
        raise MessageError("bad_version", f"protocol version {got} not supported: v must be the int {PROTOCOL_VERSION}")
    kind = d.get("kind")
    cls = REGISTRY.get(kind) if isinstance(kind, str) else None
    if cls is None or (expect is not None and kind not in expect):
        raise MessageError("unknown_kind", f"unknown message kind {kind!r}")
    msg = cls(**check_fields(cls, d, kind))
    validate = getattr(msg, "validate_head" if head_only and hasattr(msg, "validate_head") else "validate", None)
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
    if hint is float:  # NaN and the infinities are no number a field can mean (a NaN budget compared as "spent")
        return lambda val: (val.__class__ is int or (val.__class__ is float and math.isfinite(val))
                            or (isinstance(val, int) and not isinstance(val, bool)))
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


_WIRE_NAMES = {int: "int", float: "number", str: "string", bool: "bool", dict: "map", list: "list",
               tuple: "list", bytes: "binary", type(None): "null"}


def _tname(hint) -> str:
    """The wire type a hint stands for, in the words of docs/PROTOCOL.md."""
    if hint is Any:
        return "any value"
    origin = typing.get_origin(hint)
    if origin is typing.Union:
        args = typing.get_args(hint)
        names = [_tname(a) for a in args if a is not type(None)]
        return " or ".join(names) + (" or null" if type(None) in args else "")
    if origin in (list, tuple):
        args = typing.get_args(hint)
        return f"list of {_tname(args[0])}" if args else "list"
    if origin is dict:
        return "map"
    return _WIRE_NAMES.get(hint, getattr(hint, "__name__", str(hint)))


_ARTICLE = {"int": "an int", "number": "a number", "string": "a string", "bool": "a bool", "map": "a map",
            "list": "a list", "binary": "binary data", "null": "null"}


def _vname(val) -> str:
    """A decoded value's wire type, with its article ("a string", "an int", "null")."""
    if isinstance(val, np.ndarray):
        return f"an array of {val.dtype}"
    for t in (bool, int, float, str, bytes, dict, list, tuple, type(None)):
        if isinstance(val, t):
            return _ARTICLE[_WIRE_NAMES[t]]
    return type(val).__name__


def _why(hint, val) -> str:
    """What came instead of ``hint``: the value's wire type, and for a list the first item that
    does not fit (so a list of int with a string in it does not read "expected list, got list")."""
    if typing.get_origin(hint) in (list, tuple) and isinstance(val, list) and typing.get_args(hint):
        inner = typing.get_args(hint)[0]
        check = _compile(inner)
        for i, x in enumerate(val):
            if not check(x):
                return f"a list with {_why(inner, x)} at [{i}]"
    if val.__class__ is float and (hint is int or not math.isfinite(val)):
        return f"{_vname(val)} ({val!r})" + ("" if math.isfinite(val) else ": NaN and infinities are refused")
    return _vname(val)


def _positive(name: str, val, allow_zero=True):
    if val is not None and (val < 0 or (not allow_zero and val == 0)):
        raise MessageError("invalid", f"{name} must be {'>= 0' if allow_zero else '> 0'}")


def _string_keys(val, where):
    """Refuse a map key that is not a string anywhere inside ``val`` (a handler's instance): the
    codec lets binary keys through (msgpack's strict mode allows them), and a handler would only
    trip on one later, in init. Walked once without paths (the paths of every map cost ~10 us a
    task: 40 ms of a 4,096-task submit); again with them only to name a bad key."""
    stack = [val]
    while stack:
        v = stack.pop()
        if v.__class__ is dict:
            for k, x in v.items():
                if k.__class__ is not str:
                    return _string_keys_named(val, _where(where))
                if x.__class__ is dict or x.__class__ is list:
                    stack.append(x)
        elif v.__class__ is list:
            stack.extend(x for x in v if x.__class__ is dict or x.__class__ is list)


def _string_keys_named(val, where: str):
    stack = [(val, where)]
    while stack:
        v, path = stack.pop()
        if v.__class__ is dict:
            for k, x in v.items():
                if k.__class__ is not str:
                    raise MessageError("invalid", f"{path}: map keys must be strings, got {_vname(k)} key {k!r}")
                if x.__class__ in (dict, list):
                    stack.append((x, f"{path}.{k}"))
        elif v.__class__ is list:
            stack.extend((x, f"{path}[{i}]") for i, x in enumerate(v) if x.__class__ in (dict, list))


def _http_url(name: str, address: str):
    """An http(s) URL with a host and, if given, a port in 1..65535."""
    try:
        u = urlsplit(address)
        port = u.port
    except ValueError as e:
        raise MessageError("invalid", f"{name}: {address!r} is not a valid URL ({e})") from None
    if u.scheme not in ("http", "https"):
        raise MessageError("invalid", f"{name}: {address!r} must be an http(s) URL")
    if not u.hostname:
        raise MessageError("invalid", f"{name}: {address!r} has no host")
    if any(c.isspace() or not c.isprintable() for c in address):
        raise MessageError("invalid", f"{name}: {address!r} contains whitespace or control characters")
    if port == 0:
        raise MessageError("invalid", f"{name}: {address!r} has port 0")


# ---- trainer <-> gateway ------------------------------------------------------------
def _client_id(kind: str, client_id: str):
    if not client_id:
        raise MessageError("invalid", f"{kind}.client_id must not be empty (it names the client's result stream)")


@schema
class Task:
    """One element of ``submit.tasks`` (not a message: checked by ``Submit.validate``)."""

    handler: str
    instance: dict                          # the handler's input; docs/HANDLERS.md lists each one's fields
    instance_id: Optional[str] = None       # None: "auto-<first job id>", unique across submits
    n: int = 1                              # samples (jobs) of this instance, 1..4096
    timeout_s: Optional[float] = None       # None: gateway.default_budget_s
    phase_timeouts: Optional[dict] = None   # {init?, run?, eval?: seconds > 0}; None: no per-phase limit

    @staticmethod
    def check(t: dict, where) -> None:
        """``t`` (a task map) checked field by field, without building a Task (a dataclass per task
        cost ~3 us). ``where`` as in ``check_fields``."""
        check_fields(Task, t, where)
        n, timeout_s = t.get("n", 1), t.get("timeout_s")
        if not 1 <= n <= 4096:
            raise MessageError("invalid", f"{_where(where)}.n must be in 1..4096, not {n}")
        if timeout_s is not None and timeout_s <= 0:
            raise MessageError("invalid", f"{_where(where)}.timeout_s must be > 0, not {timeout_s}")
        for phase, limit in (t.get("phase_timeouts") or {}).items():
            if phase not in ("init", "run", "eval"):
                raise MessageError("invalid", f"{_where(where)}.phase_timeouts: unknown phase {phase!r} (init, run, eval)")
            if limit.__class__ not in (int, float) or not math.isfinite(limit) or limit <= 0:
                raise MessageError("invalid", f"{_where(where)}.phase_timeouts.{phase}: expected a finite number > 0, "
                                   f"got {limit!r}")
        _string_keys(t["instance"], lambda: f"{_where(where)}.instance")


@message("submit")
class Submit(Message):
    """A batch of task instances; each is run ``n`` times (one job per sample)."""

    tasks: list[dict]
    client_id: str
    idempotency_key: Optional[str] = None   # None: no de-duplication of a re-sent submit
    req_id: int = 0

    def validate(self):
        self.validate_head()
        self.check_tasks(0, len(self.tasks))

    def validate_head(self):
        """Everything but the tasks' own fields (a list of maps, not empty): the gateway checks
        those in slices (``check_tasks``), so a large submit does not hold its loop in one turn."""
        _client_id("submit", self.client_id)
        if not self.tasks:
            raise MessageError("invalid", "submit.tasks is empty")

    def check_tasks(self, start: int, stop: int):
        for i in range(start, stop):
            Task.check(self.tasks[i], lambda i=i: f"submit.tasks[{i}]")


@message("poll")
class Poll(Message):
    """Results with sequence number > ``after``; everything <= ``after`` is acknowledged."""

    client_id: str
    after: int = 0
    max_results: int = 256
    wait_s: float = 0.0
    inline_arrays: bool = False  # results' small arrays inside the header (ext 2); off: ext 1 frames only
    req_id: int = 0

    def validate(self):
        _client_id("poll", self.client_id)
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
    shard: int = -1  # the router shard to hold it; -1: the shard of the address's hash (docs/SCALING.md)
    req_id: int = 0

    def validate(self):
        if self.shard < -1:  # its upper bound (router.shards - 1) is the gateway's to check
            raise MessageError("invalid", f"add_llm_server.shard must be -1 (by address) or a shard number >= 0, got {self.shard}")
        if self.api not in ("vllm", "sglang"):
            raise MessageError("invalid", f"api must be 'vllm' or 'sglang', not {self.api!r}")
        _http_url("add_llm_server.address", self.address)
        _positive("capacity", self.capacity)
        _positive("weight", self.weight, allow_zero=False)
        if self.policy_version < 0:  # versions count checkpoints; staleness is a difference of them
            raise MessageError("invalid", f"add_llm_server.policy_version must be >= 0, got {self.policy_version}")


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

    def validate(self):
        if not 0 <= self.wait_s <= LEASE_WAIT_MAX_S:  # a router holds the request that long: bound it
            raise MessageError("invalid", f"lease.wait_s must be within 0..{LEASE_WAIT_MAX_S:g}, not {self.wait_s!r}")


LEASE_WAIT_MAX_S = 3600.0


@message("release")
class Release(Message):
    lease_id: str
    req_id: int = 0


@message("lease_batch")
class LeaseBatch(Message):
    """A run daemon's lease requests and releases of one tick in one message (docs/PROTOCOL.md,
    router requests). Each ``leases`` entry is a ``lease`` message's fields; its ``req_id`` names
    the member in the batch reply and in a later reply of its own if it had to wait."""

    requester: str = ""
    node: str = ""
    leases: list[dict] = dataclasses.field(default_factory=list)
    releases: list[str] = dataclasses.field(default_factory=list)
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
