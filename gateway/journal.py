"""The gateway's durable journal (SQLite in WAL mode).

Every job, attempt and result is written before the gateway acknowledges it; the gateway
commits once per loop turn (a group commit), then sends the replies that depend on it.
``synchronous=NORMAL`` in WAL mode survives a killed process (kill -9), which is what the
daemon must survive; set ``journal_sync = "full"`` to survive power loss as well.
``Journal(None)`` keeps nothing on disk (benchmarks, throwaway runs).
"""
from __future__ import annotations

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
CREATE TABLE IF NOT EXISTS clients (
    client_id TEXT PRIMARY KEY,
    next_seq INTEGER NOT NULL,
    acked INTEGER NOT NULL,
    seen REAL NOT NULL,
    sent INTEGER NOT NULL DEFAULT 0
);
"""


class Journal:
    def __init__(self, path: str | Path | None, sync: str = "normal"):
        self.path = str(path) if path else None
        self.db = None
        self.dirty = False
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
            self.db.execute("BEGIN")

    @property
    def durable(self) -> bool:
        return self.db is not None

    # -- writes (buffered in the open transaction until commit) ----------------------------
    def add_jobs(self, rows: list[tuple[int, str, dict]]):
        if self.db:
            now = time.time()
            self.db.executemany("INSERT INTO jobs(job_id, client_id, spec, attempt, state, updated) VALUES (?,?,?,?,?,?)",
                                [(jid, cid, codec.pack(spec), 1, "queued", now) for jid, cid, spec in rows])
            self.dirty = True

    def set_state(self, job_id: int, state: str, attempt: int | None = None):
        if self.db:
            if attempt is None:
                self.db.execute("UPDATE jobs SET state=?, updated=? WHERE job_id=?", (state, time.time(), job_id))
            else:
                self.db.execute("UPDATE jobs SET state=?, attempt=?, updated=? WHERE job_id=?", (state, attempt, time.time(), job_id))
            self.dirty = True

    def add_result(self, job_id: int, seq: int, frames: list):
        if self.db:
            blob = codec.pack([bytes(_buf(f)) for f in frames])
            self.db.execute("UPDATE jobs SET state='done', seq=?, result=?, updated=? WHERE job_id=?", (seq, blob, time.time(), job_id))
            self.dirty = True

    def ack(self, client_id: str, upto_seq: int):
        if self.db:
            self.db.execute("UPDATE jobs SET state='acked', result=NULL WHERE client_id=? AND state='done' AND seq<=?", (client_id, upto_seq))
            self.db.execute("UPDATE clients SET acked=MAX(acked, ?), seen=? WHERE client_id=?", (upto_seq, time.time(), client_id))
            self.dirty = True

    def set_client(self, client_id: str, next_seq: int, acked: int):
        if self.db:
            self.db.execute("INSERT INTO clients(client_id, next_seq, acked, seen) VALUES (?,?,?,?) "
                            "ON CONFLICT(client_id) DO UPDATE SET next_seq=excluded.next_seq, seen=excluded.seen",
                            (client_id, next_seq, acked, time.time()))
            self.dirty = True

    def set_sent(self, client_id: str, sent: int):
        """The highest sequence number a poll reply carried to the client (written before the reply goes)."""
        if self.db:
            self.db.execute("UPDATE clients SET sent=MAX(sent, ?) WHERE client_id=?", (sent, client_id))
            self.dirty = True

    def add_idempotency(self, client_id: str, key: str, job_ids: list[int]):
        if self.db:
            self.db.execute("INSERT OR IGNORE INTO idempotency VALUES (?,?,?,?)", (client_id, key, codec.pack(job_ids), time.time()))
            self.dirty = True

    def set_backend(self, address: str, spec: dict | None):
        """Remember a backend registration (None forgets it; address "" with None forgets all)."""
        if self.db:
            if spec is not None:
                self.db.execute("INSERT OR REPLACE INTO backends VALUES (?,?)", (address, codec.pack(spec)))
            elif address:
                self.db.execute("DELETE FROM backends WHERE address=?", (address,))
            else:
                self.db.execute("DELETE FROM backends")
            self.dirty = True

    def backends(self) -> dict[str, dict]:
        if not self.db:
            return {}
        return {a: codec.unpack(spec) for a, spec in self.db.execute("SELECT address, spec FROM backends")}

    def commit(self):
        """The group commit: one fsync point for everything written this loop turn."""
        if self.db and self.dirty:
            self.db.execute("COMMIT")
            self.db.execute("BEGIN")
            self.dirty = False

    def prune(self, older_than_s: float) -> int:
        """Drop acknowledged jobs and old idempotency keys: the journal's disk use stays bounded."""
        if not self.db:
            return 0
        cutoff = time.time() - older_than_s
        n = self.db.execute("DELETE FROM jobs WHERE state IN ('acked','dropped') AND updated < ?", (cutoff,)).rowcount
        self.db.execute("DELETE FROM idempotency WHERE created < ?", (cutoff,))
        self.dirty = True
        self.commit()
        self.db.execute("COMMIT")
        self.db.execute("PRAGMA wal_checkpoint(TRUNCATE)")
        self.db.execute("BEGIN")
        return n

    # -- recovery ----------------------------------------------------------------------------
    def max_job_id(self) -> int:
        if not self.db:
            return 0
        return self.db.execute("SELECT COALESCE(MAX(job_id), 0) FROM jobs").fetchone()[0]

    def unfinished(self):
        """(job_id, client_id, spec, attempt, state, seq, result frames) of every job not yet acknowledged."""
        if not self.db:
            return []
        rows = self.db.execute("SELECT job_id, client_id, spec, attempt, state, seq, result FROM jobs "
                               "WHERE state NOT IN ('acked','dropped') ORDER BY job_id").fetchall()
        return [(jid, cid, codec.unpack(spec), att, st, seq, codec.unpack(res) if res else None)
                for jid, cid, spec, att, st, seq, res in rows]

    def clients(self) -> dict[str, tuple[int, int, int]]:
        """client_id -> (next_seq, acked, sent)."""
        if not self.db:
            return {}
        return {cid: (n, a, s) for cid, n, a, s in self.db.execute("SELECT client_id, next_seq, acked, sent FROM clients")}

    def job_state(self, job_id: int) -> str | None:
        """A job's journalled state (``acked`` and ``dropped`` rows stay until pruned); None if unknown."""
        if not self.db:
            return None
        row = self.db.execute("SELECT state FROM jobs WHERE job_id=?", (job_id,)).fetchone()
        return row[0] if row else None

    def idempotency(self) -> dict[tuple[str, str], list[int]]:
        if not self.db:
            return {}
        return {(c, k): codec.unpack(ids) for c, k, ids in self.db.execute("SELECT client_id, key, job_ids FROM idempotency")}

    def close(self):
        if self.db:
            self.commit()
            self.db.execute("COMMIT")
            self.db.close()
            self.db = None


def _buf(f):
    return getattr(f, "buffer", f)
