"""Late results of the jobs overprovision / dynamic_sample (and a batch deadline) cancel are
acknowledged at once, in the background, not at the client's next poll (issue 28 item 6: they
stayed `done_unacked` at the gateway, 10-15 of them, until the client polled again, and for
`retention_s` if it never did). A real ``rolloutd up`` of its own (done_unacked counts every client)."""
from __future__ import annotations

from rolloutd.gateway.batch import BatchClient
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
