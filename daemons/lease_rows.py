"""The ``leases`` field of a ``run.leases`` event: a run daemon's LLM leases, as rows or packed.

Rows are ``[lease_id, backend_id, job_id, policy_version]``. A run daemon at 512 slots lists 512
of them with every full heartbeat listing; as msgpack lists they cost the router ~0.3 ms to decode
and as much again to walk (docs/SCALING.md, section 7), ~1,000 events a second at 5,000 nodes. So
above PACK_MIN rows the field is a map instead (docs/EVENTS.md):
``{"ids": "L1-4\\nL1-9...", "backends": [backend ids], "rows": bin}``, where ``rows`` is
little-endian int64 triples ``[index into backends, job_id, policy_version]`` in the order of
``ids``. The router needs only the ids to renew (one string split, set operations in C); the rest is
read for the few ids it must adopt (after its own restart).
"""
from __future__ import annotations

import numpy as np

PACK_MIN = 16
ROW_BYTES = 24
_I8 = np.dtype("<i8")


class LeaseRows:
    """A decoded ``leases`` field: the ids, and each id's row on demand (for adoption)."""

    __slots__ = ("ids", "_rows", "_backends", "_list")

    def __init__(self, ids: list, rows=None, backends=None, listed=None):
        self.ids = ids
        self._rows, self._backends, self._list = rows, backends, listed

    def row(self, i: int) -> tuple | None:
        """``(backend_id, job_id, policy_version)`` of the i-th id, or None when that row is malformed."""
        if self._list is not None:
            r = self._list[i]
            return r[1], r[2], r[3]
        if self._rows.__class__ is bytes:  # read only when an id must be adopted
            self._rows = np.frombuffer(self._rows, dtype=_I8).reshape(-1, 3)
        b, job, version = self._rows[i].tolist()
        if not 0 <= b < len(self._backends):
            return None
        return self._backends[b], job, version


def pack(rows: list) -> list | dict:
    """``rows`` (the run daemon's held leases) as the event's ``leases`` field."""
    if len(rows) <= PACK_MIN or any("\n" in r[0] for r in rows):
        return rows
    index: dict = {}
    a = np.empty((len(rows), 3), dtype=_I8)
    a[:, 0] = [index.setdefault(r[1], len(index)) for r in rows]
    a[:, 1] = [r[2] for r in rows]
    a[:, 2] = [r[3] for r in rows]
    return {"ids": "\n".join(r[0] for r in rows), "backends": list(index), "rows": a.tobytes()}


def unpack(field) -> LeaseRows | None:
    """The ``leases`` field as ``LeaseRows``, or None when it is malformed (the event is ignored)."""
    if field.__class__ is list:
        ok = [r for r in field if r.__class__ is list and len(r) == 4 and r[0].__class__ is str
              and r[1].__class__ is str and r[2].__class__ is int and r[3].__class__ is int]
        return LeaseRows([r[0] for r in ok], listed=ok)
    if field.__class__ is not dict:
        return None
    ids, backends, raw = field.get("ids"), field.get("backends"), field.get("rows")
    if ids.__class__ is not str or raw.__class__ is not bytes or backends.__class__ is not list \
            or not all(b.__class__ is str for b in backends):
        return None
    ids = ids.split("\n") if ids else []
    if len(raw) != ROW_BYTES * len(ids):
        return None
    return LeaseRows(ids, rows=raw, backends=backends)
