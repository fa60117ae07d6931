"""Late results of the jobs overprovision / dynamic_sample (and a batch deadline) cancel are
acknowledged at once, in the background, not at the client's next poll (issue 28 item 6: they
stayed `done_unacked` at the gateway, 10-15 of them, until the client polled again, and for
`retention_s` if it never did). A real ``rolloutd up`` of its own (done_unacked counts every client)."""
from __future__ import annotations

import time

from rolloutd.gateway.batch import LATE_ACK_POLL_S, BatchClient
from tests.conftest import wait_for


def task(iid, run_s=0.0):
    return {"handler": "synthetic", "instance_id": iid, "instance": {"run": run_s, "reward": 1.0, "seed": 1}}


def test_cancelled_jobs_late_results_are_acknowledged_without_another_poll(up):
    with up.client() as status, BatchClient(up.gateway, poll_wait_s=0.2) as c:
        tasks = [task(f"fast{k}", 0.02) for k in range(3)] + [task(f"slow{k}", 60.0) for k in range(3)]
        res = c.overprovision(tasks, n=2, want=3, extra=1.0, deadline_s=120)
        assert len(res.groups) == 3 and len(res.cancelled) == 6
        # Nothing more is asked of the client: its background poll acknowledges the cancelled results.
        wait_for(lambda: c.dropped_late == 6, timeout_s=60, what="the six cancelled results to come back")
        assert c.late_statuses == {"cancelled": 6}, c.late_statuses
        wait_for(lambda: status.status()["done_unacked"] == 0, timeout_s=30,
                 what="the gateway to hold no unacknowledged result")
        # A batch deadline abandons jobs the same way.
        b = c.submit([task("late", 60.0)], n=2, deadline_s=0.5)
        out = c.gather(b)
        assert [r["error"]["type"] for r in out] == ["BatchDeadline"] * 2
        wait_for(lambda: c.dropped_late == 8 and status.status()["done_unacked"] == 0, timeout_s=60,
                 what="the deadline's cancelled results acknowledged")
        assert status.status()["dispatched"] == 0 and status.status()["queued"] == 0


def test_close_waits_for_the_ackers_poll_before_closing_its_socket(up):
    """A zmq socket is one thread's. With the gateway frozen (SIGSTOP), the background acker sits
    in a poll that outlasts close()'s join (the poll's retries); close() must not close the
    poller's socket under it (a closed socket made the acker's poll fail silently, or worse, in
    libzmq): it closes it only after that poll ended, and the acker raised nothing."""
    import os
    import signal
    import threading

    errors: list = []
    hook, threading.excepthook = threading.excepthook, lambda a: errors.append(a.exc_value)
    gw, run = up.daemon_pid("gateway"), up.daemon_pid("run")
    c = BatchClient(up.gateway, poll_wait_s=0.2, timeout_s=1.0, retries=2)
    try:
        b = c.submit([task("slow", 60.0)], n=2, deadline_s=1.0)
        with up.client() as st:
            wait_for(lambda: st.status()["dispatched"] == 2, timeout_s=30, what="both jobs running")
        os.kill(run, signal.SIGSTOP)  # the cancelled jobs' results cannot come: the acker keeps polling
        try:
            assert [r["error"]["type"] for r in c.gather(b)] == ["BatchDeadline"] * 2
            acker = c._acker
            assert acker is not None and acker.is_alive()
            in_flight, polls_at_close = [], []
            request, close_socket = c._poller.request, c._poller.close

            def watched(*a, **kw):  # counts the acker's requests in flight on the poller's socket
                in_flight.append(1)
                try:
                    return request(*a, **kw)
                finally:
                    in_flight.pop()

            c._poller.request = watched
            c._poller.close = lambda: (polls_at_close.append(len(in_flight)), close_socket())
            os.kill(gw, signal.SIGSTOP)  # ...and its next poll hangs through all its retries
            try:
                time.sleep(2 * LATE_ACK_POLL_S)
                c.close()
                assert polls_at_close == [0], "close() closed the poller's socket under the acker's poll"
            finally:
                os.kill(gw, signal.SIGCONT)
        finally:
            os.kill(run, signal.SIGCONT)
    finally:
        c.close()
        threading.excepthook = hook
    assert errors == []
