"""The gateway's durable journal (SQLite in WAL mode).

Every job, attempt and result is written before the gateway acknowledges it; the gateway
commits once per loop turn (a group commit), then sends the replies that depend on it.
``synchronous=NORMAL`` in WAL mode survives a killed process (kill -9), which is what the
daemon must survive; set ``journal_sync = "full"`` to survive power loss as well.
``Journal(None)`` keeps nothing on disk (benchmarks, throwaway runs).

A full disk: writes are kept as pending statements and run in one transaction at commit.
When the commit fails for want of space (SQLite rolls the whole transaction back), the
statements stay pending, ``commit`` returns False and ``failing`` is set; the gateway then
sends nothing that depends on them and refuses new work (error ``journal_full``). Each
later commit (at most every RETRY_S) runs them again; once one sticks, the turn's replies go
out. Committed rows are never touched by a failed commit.

A task run ``n > 1`` times stores its instance once (``instances``, keyed by the task's first job
id; its jobs name it in ``instance_ref``): stored per job, one 16 MiB request could write 4,096
copies. A submit is written over several loop turns (gateway/submits.py) under an ``open_submits``
mark that its last turn removes; recovery deletes the jobs of a mark still open (that submit was
never answered). A journal written with these tables needs this gateway version or a later one.
"""
from __future__ import annotations

import os
import sqlite3
import time
from pathlib import Path

from rolloutd.bus import codec

SCHEMA = """
CREATE TABLE IF NOT EXISTS jobs (
    job_id INTEGER PRIMARY KEY,
    client_id TEXT NOT NULL,
    spec BLOB NOT NULL,
    attempt INTEGER NOT NULL,
    state TEXT NOT NULL,
    seq INTEGER,
    result BLOB,
    updated REAL NOT NULL
);
CREATE INDEX IF NOT EXISTS jobs_state ON jobs(state);
CREATE TABLE IF NOT EXISTS idempotency (
    client_id TEXT NOT NULL,
    key TEXT NOT NULL,
    job_ids BLOB NOT NULL,
    created REAL NOT NULL,
    PRIMARY KEY (client_id, key)
);
CREATE TABLE IF NOT EXISTS backends (
    address TEXT PRIMARY KEY,
    spec BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS instances (
    id INTEGER PRIMARY KEY,
    n INTEGER NOT NULL,
    data BLOB NOT NULL
);
CREATE TABLE IF NOT EXISTS open_submits (
    first INTEGER PRIMARY KEY,
    last INTEGER NOT NULL
);
CREATE TABLE IF NOT EXISTS clients (
    client_id TEXT PRIMARY KEY,
    next_seq INTEGER NOT NULL,
    acked INTEGER NOT NULL,
    seen REAL NOT NULL,
    sent INTEGER NOT NULL DEFAULT 0
);
"""


# SQLITE_IOERR (ENOSPC on a WAL truncate or fsync surfaces as one) and SQLITE_FULL.
_NO_SPACE_CODES = (10, 13)
RETRY_S = 0.5  # a failing commit is retried at most this often (each try writes until ENOSPC)


def no_space(e: BaseException) -> bool:
    code = getattr(e, "sqlite_errorcode", None)
    if code is not None:
        return (code & 0xFF) in _NO_SPACE_CODES
    return isinstance(e, sqlite3.OperationalError) and ("disk is full" in str(e) or "disk I/O" in str(e))


class Journal:
    def __init__(self, path: str | Path | None, sync: str = "normal"):
        self.path = str(path) if path else None
        self.db = None
        self.dirty = False
        self.pending: list[tuple[str, object, bool]] = []  # (sql, params, executemany) not yet committed
        self._client_row: dict[str, int] = {}  # client id -> index in pending of its set_client upsert
        self.failing = False   # the last commit failed for want of space; pending holds its statements
        self.error = ""        # why (SQLite's message), while failing
        self._retry_at = 0.0
        if self.path:
            Path(self.path).parent.mkdir(parents=True, exist_ok=True)
            self.db = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False)
            self.db.execute("PRAGMA journal_mode=WAL")
            self.db.execute(f"PRAGMA synchronous={'FULL' if sync == 'full' else 'NORMAL'}")
            self.db.executescript(SCHEMA)
            cols = {r[1] for r in self.db.execute("PRAGMA table_info(clients)")}
            if "sent" not in cols:
                # A journal from before ``sent`` was kept: trust every sequence number it issued.
                self.db.execute("ALTER TABLE clients ADD COLUMN sent INTEGER NOT NULL DEFAULT 0")
                self.db.execute("UPDATE clients SET sent = next_seq - 1")
            if "instance_ref" not in {r[1] for r in self.db.execute("PRAGMA table_info(jobs)")}:
                self.db.execute("ALTER TABLE jobs ADD COLUMN instance_ref INTEGER")  # NULL: the spec holds it

    @property
    def durable(self) -> bool:
        return self.db is not None

    def free_bytes(self) -> int | None:
        """Bytes an unprivileged writer can still use on the journal's filesystem."""
        if not self.path:
            return None
        try:
            st = os.statvfs(Path(self.path).parent)
        except OSError:
            return None
        return st.f_bavail * st.f_frsize

    # -- writes (pending until commit runs them in one transaction) ----------------------------
    def _write(self, sql: str, params, many: bool = False):
        self.pending.append((sql, params, many))
        self.dirty = True

    def add_jobs(self, rows: list[tuple]):
        """Rows ``(job_id, client_id, spec)`` or ``(job_id, client_id, spec, instance_ref)``: with a
        ref, the spec is stored without its instance (``add_instance`` stored it once)."""
        if self.db:
            now = time.time()
            out = []
            for row in rows:
                jid, cid, spec = row[:3]
                ref = row[3] if len(row) > 3 else None
                if ref is not None:
                    spec = {k: v for k, v in spec.items() if k != "instance"}
                out.append((jid, cid, codec.pack(spec), 1, "queued", now, ref))
            self._write("INSERT INTO jobs(job_id, client_id, spec, attempt, state, updated, instance_ref) "
                        "VALUES (?,?,?,?,?,?,?)", out, many=True)

    def add_instance(self, ref: int, n: int, instance: dict):
        """The instance of the task whose ``n`` jobs are ``ref .. ref + n - 1``."""
        if self.db:
            self._write("INSERT INTO instances(id, n, data) VALUES (?,?,?)", (ref, n, codec.pack(instance)))

    def open_submit(self, first: int, last: int):
        """Jobs ``first .. last`` are being written over several turns: recovery drops them until ``close_submit``."""
        if self.db:
            self._write("INSERT INTO open_submits(first, last) VALUES (?,?)", (first, last))

    def close_submit(self, first: int):
        if self.db:
            self._write("DELETE FROM open_submits WHERE first=?", (first,))

    def drop_submit(self, first: int, last: int):
        """Undo what an open submit wrote (it failed part-way)."""
        if self.db:
            self._write("DELETE FROM jobs WHERE job_id BETWEEN ? AND ?", (first, last))
            self._write("DELETE FROM instances WHERE id BETWEEN ? AND ?", (first, last))
            self._write("DELETE FROM open_submits WHERE first=?", (first,))

    def set_state(self, job_id: int, state: str, attempt: int | None = None):
        if self.db:
            if attempt is None:
                self._write("UPDATE jobs SET state=?, updated=? WHERE job_id=?", (state, time.time(), job_id))
            else:
                self._write("UPDATE jobs SET state=?, attempt=?, updated=? WHERE job_id=?", (state, attempt, time.time(), job_id))

    def add_result(self, job_id: int, seq: int, frames: list):
        if self.db:
            blob = codec.pack([bytes(_buf(f)) for f in frames])
            self._write("UPDATE jobs SET state='done', seq=?, result=?, updated=? WHERE job_id=?", (seq, blob, time.time(), job_id))

    def ack(self, client_id: str, upto_seq: int):
        if self.db:
            self._write("UPDATE jobs SET state='acked', result=NULL WHERE client_id=? AND state='done' AND seq<=?", (client_id, upto_seq))
            self._write("UPDATE clients SET acked=MAX(acked, ?), seen=? WHERE client_id=?", (upto_seq, time.time(), client_id))

    def set_client(self, client_id: str, next_seq: int, acked: int):
        """One upsert per client per commit, holding its latest values: a turn that finishes 256
        jobs of one client wrote 256 (each result paid for two statements). The values are the
        client's whole state, and every other write of this row (``ack``, ``set_sent``) only
        raises a column with MAX, so the earlier position in the transaction changes nothing."""
        if self.db:
            row = (client_id, next_seq, acked, time.time())
            i = self._client_row.get(client_id)
            if i is not None:
                self.pending[i] = (self.pending[i][0], row, False)
                return
            self._client_row[client_id] = len(self.pending)
            self._write("INSERT INTO clients(client_id, next_seq, acked, seen) VALUES (?,?,?,?) "
                        "ON CONFLICT(client_id) DO UPDATE SET next_seq=excluded.next_seq, seen=excluded.seen", row)

    def set_sent(self, client_id: str, sent: int):
        """The highest sequence number a poll reply carried to the client (written before the reply goes)."""
        if self.db:
            self._write("UPDATE clients SET sent=MAX(sent, ?) WHERE client_id=?", (sent, client_id))

    def add_idempotency(self, client_id: str, key: str, job_ids: list[int]):
        if self.db:
            self._write("INSERT OR IGNORE INTO idempotency VALUES (?,?,?,?)", (client_id, key, codec.pack(job_ids), time.time()))

    def set_backend(self, address: str, spec: dict | None):
        """Remember a backend registration (None forgets it; address "" with None forgets all)."""
        if self.db:
            if spec is not None:
                self._write("INSERT OR REPLACE INTO backends VALUES (?,?)", (address, codec.pack(spec)))
            elif address:
                self._write("DELETE FROM backends WHERE address=?", (address,))
            else:
                self._write("DELETE FROM backends", ())

    def backends(self) -> dict[str, dict]:
        if not self.db:
            return {}
        return {a: codec.unpack(spec) for a, spec in self.db.execute("SELECT address, spec FROM backends")}

    def commit(self) -> bool:
        """The group commit: one fsync point for everything written this loop turn (and any
        turn whose commit failed before). True once all of it is durable; False when the disk
        is full (the statements stay pending; see the module docstring)."""
        if not self.db or not self.pending:
            return True
        if self.failing and time.monotonic() < self._retry_at:
            return False
        try:
            self.db.execute("BEGIN")
            for sql, params, many in self.pending:
                (self.db.executemany if many else self.db.execute)(sql, params)
            self.db.execute("COMMIT")
        except sqlite3.Error as e:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            if not no_space(e):
                raise
            self._retry_at = time.monotonic() + RETRY_S
            self.failing, self.error = True, f"{e}"
            return False
        self.pending.clear()
        self._client_row.clear()
        self.dirty = self.failing = False
        self.error = ""
        return True

    def prune(self, older_than_s: float) -> int:
        """Drop acknowledged jobs and old idempotency keys: the journal's disk use stays bounded."""
        if not self.db or not self.commit():
            return 0
        cutoff = time.time() - older_than_s
        try:
            self.db.execute("BEGIN")
            n = self.db.execute("DELETE FROM jobs WHERE state IN ('acked','dropped') AND updated < ?", (cutoff,)).rowcount
            # An instance goes with the last of its task's jobs (they are the ids id .. id + n - 1).
            self.db.execute("DELETE FROM instances WHERE NOT EXISTS "
                            "(SELECT 1 FROM jobs WHERE job_id BETWEEN instances.id AND instances.id + instances.n - 1)")
            self.db.execute("DELETE FROM idempotency WHERE created < ?", (cutoff,))
            self.db.execute("COMMIT")
            self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        except sqlite3.Error as e:
            if self.db.in_transaction:
                self.db.execute("ROLLBACK")
            if not no_space(e):
                raise
            return 0  # pruning is an optimisation: the next prune tries again
        return n

    # -- recovery ----------------------------------------------------------------------------
    def max_job_id(self) -> int:
        if not self.db:
            return 0
        return self.db.execute("SELECT COALESCE(MAX(job_id), 0) FROM jobs").fetchone()[0]

    def rollback_open_submits(self) -> int:
        """At recovery: delete the jobs of every submit still open (never answered); returns how many."""
        if not self.db:
            return 0
        marks = self.db.execute("SELECT first, last FROM open_submits").fetchall()
        if not marks:
            return 0
        n = 0
        self.db.execute("BEGIN")
        for first, last in marks:
            n += self.db.execute("DELETE FROM jobs WHERE job_id BETWEEN ? AND ?", (first, last)).rowcount
            self.db.execute("DELETE FROM instances WHERE id BETWEEN ? AND ?", (first, last))
        self.db.execute("DELETE FROM open_submits")
        self.db.execute("COMMIT")
        return n

    def unfinished(self):
        """(job_id, client_id, spec, attempt, state, seq, result frames) of every job not yet
        acknowledged. The samples of one task share one instance object, as they did when submitted."""
        if not self.db:
            return []
        rows = self.db.execute("SELECT job_id, client_id, spec, attempt, state, seq, result, instance_ref FROM jobs "
                               "WHERE state NOT IN ('acked','dropped') ORDER BY job_id").fetchall()
        refs = sorted({r[7] for r in rows if r[7] is not None})
        instances = {}
        for i in range(0, len(refs), 500):
            part = refs[i:i + 500]
            instances.update((ref, codec.unpack(data)) for ref, data in self.db.execute(
                f"SELECT id, data FROM instances WHERE id IN ({','.join('?' * len(part))})", part))
        out = []
        for jid, cid, spec, att, st, seq, res, ref in rows:
            spec = codec.unpack(spec)
            if ref is not None:
                spec["instance"] = instances[ref]  # written in the turn of the task's first job
            out.append((jid, cid, spec, att, st, seq, codec.unpack(res) if res else None))
        return out

    def clients(self) -> dict[str, tuple[int, int, int]]:
        """client_id -> (next_seq, acked, sent)."""
        if not self.db:
            return {}
        return {cid: (n, a, s) for cid, n, a, s in self.db.execute("SELECT client_id, next_seq, acked, sent FROM clients")}

    def job_states(self, job_ids) -> dict[int, str]:
        """Journalled states (``acked`` and ``dropped`` rows stay until pruned) of those of
        ``job_ids`` the journal knows; one query per 500 ids (a query per id cost ~16 us: a cancel
        naming 1,000,000 ids stalled the gateway 16 s, issue 38)."""
        ids = [j for j in job_ids if -(1 << 63) <= j < (1 << 63)]  # beyond SQLite's INTEGER: never ours
        if not self.db or not ids:
            return {}
        self.commit()  # this turn's writes first (they are what the answer must reflect)
        out = {}
        for i in range(0, len(ids), 500):
            part = ids[i:i + 500]
            out.update(self.db.execute(f"SELECT job_id, state FROM jobs WHERE job_id IN ({','.join('?' * len(part))})",
                                       part).fetchall())
        return out

    def idempotency(self) -> dict[tuple[str, str], list[int]]:
        if not self.db:
            return {}
        return {(c, k): codec.unpack(ids) for c, k, ids in self.db.execute("SELECT client_id, key, job_ids FROM idempotency")}

    def close(self):
        if self.db:
            self.commit()  # if it fails nothing pending was acknowledged: the statements may go
            self.db.close()
            self.db = None


def _buf(f):
    return getattr(f, "buffer", f)
