"""The gateway under ENOSPC (issue 17.2): its journal on a small tmpfs that fills to the last
byte. It keeps answering, refuses work it cannot journal (error journal_full), acknowledges
nothing it did not commit, keeps what it committed, and recovers on its own."""
from __future__ import annotations

import sqlite3
import time

from rolloutd.gateway.client import GatewayError, GatewayTimeout
from rolloutd.gateway.journal import Journal

from tests.conftest import synthetic
from tests.disk.fs import Filler, free_bytes, small_tmpfs


def _count(path) -> int:
    db = sqlite3.connect(f"file:{path}?mode=ro", uri=True)
    try:
        return db.execute("SELECT COUNT(*) FROM jobs").fetchone()[0]
    finally:
        db.close()


def test_commit_fails_cleanly_and_succeeds_once_space_returns():
    with small_tmpfs(1024) as fs:
        j = Journal(fs / "j.db")
        spec = {"handler": "synthetic", "instance": {"pad": "x" * 2000}}
        committed = 0
        filler = Filler(fs)
        filler.fill()
        failed_at = None
        for i in range(1, 2000):
            j.add_jobs([(i, "c", spec)])
            if not j.commit():
                failed_at = i
                break
            committed = i
        assert failed_at is not None, "the journal never filled"
        assert j.failing and ("full" in j.error or "I/O" in j.error), j.error
        assert j.pending  # the failed turn's statements are kept ...
        assert _count(fs / "j.db") == committed  # ... and what was committed is intact
        j.add_jobs([(failed_at + 1, "c", spec)])
        assert not j.commit()  # within the retry period: not even tried
        filler.release()
        time.sleep(0.6)  # journal.RETRY_S
        assert j.commit() and not j.failing and not j.pending
        assert _count(fs / "j.db") == failed_at + 1
        j.close()


def _try(fn, *a, **kw):
    try:
        return fn(*a, **kw), None
    except GatewayError as e:
        assert e.code == "journal_full", (e.code, e.message)
        assert "cannot write its journal" in e.message
        return None, e
    except GatewayTimeout as e:  # a reply held while the commit it depends on waits for space
        return None, e


def test_journal_filled_to_the_last_byte_during_a_1000_job_batch(up_factory):
    with small_tmpfs(16 * 1024) as fs:
        up = up_factory(f"gateway.journal={fs}/journal.db")
        batches = {f"b{b}": [synthetic(b * 50 + i, run=0.02) for i in range(50)] for b in range(20)}
        acked: dict[str, list[int]] = {}
        results: dict[int, list[dict]] = {}
        filler = Filler(fs)
        with up.client(timeout_s=3, retries=1) as c, up.client(timeout_s=3, retries=0) as probe:
            def poll():
                got, _ = _try(c.poll, max_results=1000)
                for r in got or ():
                    results.setdefault(r["job_id"], []).append(r)

            full_seen = refused_while_full = False
            for n, (key, tasks) in enumerate(batches.items()):
                if n == 8:
                    filler.fill()  # to the last byte, mid-batch
                if n >= 8:
                    filler.fill()  # whatever the journal gave back, take it too
                ids, err = _try(c.submit, tasks, idempotency_key=key)
                if ids is not None:
                    acked[key] = ids
                poll()
                st, _ = _try(probe.status)
                if st and st.get("journal_full"):
                    full_seen = True
                    refused_while_full |= isinstance(err, GatewayError)
            # Keep the disk full until the gateway says it cannot journal (results keep arriving).
            deadline = time.monotonic() + 60
            while not full_seen:
                assert time.monotonic() < deadline, "the journal never filled up\n" + up.log()[-3000:]
                filler.fill()
                poll()
                st, _ = _try(probe.status)
                full_seen = bool(st and st.get("journal_full"))
            assert free_bytes(fs) < 4096
            # Full: it still answers, and refuses a submit at once with journal_full.
            t0 = time.monotonic()
            ids, err = _try(probe.submit, [synthetic(5000)], idempotency_key="while-full")
            assert ids is None and isinstance(err, GatewayError), err
            assert probe.status()["journal_full"] is True
            assert time.monotonic() - t0 < 3  # answered, not left to time out (a bound, not a speed target)
            # Space returns: it recovers on its own.
            filler.release()
            deadline = time.monotonic() + 30
            while probe.status()["journal_full"]:
                assert time.monotonic() < deadline, "the gateway did not recover\n" + up.log()[-3000:]
                time.sleep(0.1)
            for key, tasks in batches.items():  # refused (or unanswered) batches, retried with their key
                while key not in acked:
                    ids, _ = _try(c.submit, tasks, idempotency_key=key)
                    if ids is not None:
                        acked[key] = ids
            want = {j for ids in acked.values() for j in ids}
            deadline = time.monotonic() + 120
            while not want <= set(results):
                assert time.monotonic() < deadline, f"{len(want - set(results))} acknowledged jobs have no result"
                poll()
            for _ in range(3):  # nothing more arrives
                poll()
        assert len(want) == 1000
        assert set(results) == want, "results for jobs nobody was told about"
        dup = {j: len(r) for j, r in results.items() if len(r) != 1}
        assert not dup, f"jobs with more than one result: {dup}"
        assert all(r[0]["status"] == "ok" for r in results.values())
        assert refused_while_full or "request_rejected" in up.log()
        assert "journal_full" in up.log() and "journal_writable_again" in up.log()


def test_gateway_killed_while_its_journal_is_full_comes_back_and_keeps_every_acknowledged_job(up_factory):
    import os
    import signal

    with small_tmpfs(16 * 1024) as fs:
        up = up_factory(f"gateway.journal={fs}/journal.db")
        filler = Filler(fs)
        with up.client(timeout_s=3, retries=1) as c:
            first = c.submit([synthetic(i, run=0.02) for i in range(50)], idempotency_key="before")
            filler.fill()
            # Work that cannot be journalled: held, then refused.
            _try(c.submit, [synthetic(100 + i) for i in range(50)], idempotency_key="during")
            assert c.status()["journal_full"] is True
            old = up.daemon_pid("gateway")
            os.kill(old, signal.SIGKILL)
            deadline = time.monotonic() + 60
            while True:  # the supervisor restarts it on the full disk; it opens its journal and answers
                assert time.monotonic() < deadline, "the gateway did not come back on a full disk\n" + up.log()[-3000:]
                st, _ = _try(c.status)
                if st is not None:
                    break
            ids, err = _try(c.submit, [synthetic(200)], idempotency_key="after-restart")
            assert ids is None, "acknowledged a submit on a full disk"
            filler.release()
            results: dict[int, list] = {}
            later = None
            deadline = time.monotonic() + 90
            while later is None:
                assert time.monotonic() < deadline, "submits still refused after space came back\n" + up.log()[-3000:]
                later, _ = _try(c.submit, [synthetic(100 + i) for i in range(50)], idempotency_key="during")
            # Its first try may have been committed after all once space came back: the key says.
            again = None
            while again is None:
                assert time.monotonic() < deadline
                again, _ = _try(c.submit, [synthetic(200)], idempotency_key="after-restart")
            want = set(first) | set(later) | set(again)
            while not want <= set(results):
                assert time.monotonic() < deadline, f"{len(want - set(results))} acknowledged jobs have no result"
                got, _ = _try(c.poll, max_results=1000)
                for r in got or ():
                    results.setdefault(r["job_id"], []).append(r)
        assert all(len(v) == 1 for v in results.values()), "a job with two results"
        assert set(results) == want
