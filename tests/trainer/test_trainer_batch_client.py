"""BatchClient against a real ``rolloutd up`` (synthetic handler: no LLM, no sandbox)."""
from __future__ import annotations

import asyncio
import time

import pytest

from rolloutd.gateway.batch import Batch, BatchClient, GatewayTimeout, collate, group_by_instance


def task(iid, run_s=0.0, reward=1.0, **kw):
    return {"handler": "synthetic", "instance_id": iid,
            "instance": dict({"run": run_s, "reward": reward, "seed": 1}, **kw)}


@pytest.fixture(scope="module")
def gw(shared_up):
    return shared_up.gateway


def test_results_complete_ordered_and_grouped(gw):
    with BatchClient(gw, poll_wait_s=0.2) as c:
        tasks = [task(f"i{k}", run_s=0.05 * (3 - k), reward=k) for k in range(3)]
        batch = c.submit(tasks, n=4, deadline_s=60)
        assert len(batch) == 12 and batch.instance_ids == ["i0", "i1", "i2"]
        seen = list(c.results(batch))
        assert batch.done and len(seen) == 12 and len({r["job_id"] for r in seen}) == 12
        assert {r["status"] for r in seen} == {"ok"}
        groups = group_by_instance(seen)
        assert {k: len(v) for k, v in groups.items()} == {"i0": 4, "i1": 4, "i2": 4}
        assert all(r["reward"] == float(r["instance_id"][1:]) for r in seen)
        # gather: submission order, task by task, sample by sample
        out = c.run(tasks[:2], n=3, deadline_s=60)
        assert [(r["instance_id"], r["sample_index"]) for r in out] == [
            ("i0", 0), ("i0", 1), ("i0", 2), ("i1", 0), ("i1", 1), ("i1", 2)]
        assert collate(out)["status"].all()


def test_per_task_n_and_empty_submit(gw):
    with BatchClient(gw) as c:
        b = c.submit([dict(task("a"), n=1), task("b")], n=3)
        assert b.n == [1, 3] and len(c.gather(b)) == 4
        with pytest.raises(ValueError):
            c.submit([])


def test_default_instance_ids_are_unique_across_submits(gw):
    """Tasks without an instance_id take the gateway's auto-<first job id>: two submits of the same
    unnamed tasks never share a GRPO group (issue 13.3), and the batch knows the ids it will see."""
    unnamed = [{"handler": "synthetic", "instance": {"run": 0.0, "reward": 1.0, "seed": s}} for s in (1, 2)]
    with BatchClient(gw, poll_wait_s=0.2) as c:
        b1, b2 = c.submit(unnamed, n=2, deadline_s=60), c.submit(unnamed, n=2, deadline_s=60)
        res = c.gather(b1) + c.gather(b2)
    ids = b1.instance_ids + b2.instance_ids
    assert len(set(ids)) == 4 and all(i.startswith("auto-") for i in ids), ids
    assert b1.instance_ids == [f"auto-{b1.job_ids[0]}", f"auto-{b1.job_ids[2]}"]
    groups = group_by_instance(res)
    assert sorted(groups) == sorted(ids) and all(len(v) == 2 for v in groups.values())


def test_a_call_arriving_while_a_coalesced_submit_is_in_flight_is_submitted(gw, monkeypatch):
    """asubmit_one coalesces calls; one that arrives while the previous coalesced submit is still
    on its way to the gateway must get its own submit (it used to wait forever: found as a
    veRL V1 step hanging one time in six)."""
    async def main(c):
        orig = c.submit

        def slow_submit(*a, **kw):  # holds the first submit in flight while the second call arrives
            time.sleep(0.5)
            return orig(*a, **kw)

        monkeypatch.setattr(c, "submit", slow_submit)
        first = asyncio.ensure_future(c.arollout(task("late0")))
        await asyncio.sleep(c.coalesce_s + 0.2)
        return await asyncio.wait_for(asyncio.gather(first, c.arollout(task("late1"))), 60)

    with BatchClient(gw, poll_wait_s=0.2) as c:
        res = asyncio.run(main(c))
    assert [r["instance_id"] for r in res] == ["late0", "late1"] and all(r["status"] == "ok" for r in res)


def test_deadline_cancels_and_stands_in(gw):
    with BatchClient(gw, poll_wait_s=0.2) as c:
        tasks = [task("fast", run_s=0.0), task("slow", run_s=30.0)]
        t0 = time.monotonic()
        res = c.gather(c.submit(tasks, n=2, deadline_s=2.0))
        took = time.monotonic() - t0
        assert took < 10, took
        by = {(r["instance_id"], r["sample_index"]): r for r in res}
        assert len(res) == 4
        assert all(by[("fast", k)]["status"] == "ok" for k in range(2))
        for k in range(2):
            r = by[("slow", k)]
            assert r["status"] == "timeout" and r["error"]["type"] == "BatchDeadline" and r["client_side"]
        # the cancelled jobs' own results arrive later: acknowledged and dropped, never delivered
        later = c.gather(c.submit([task("next")], n=2, deadline_s=60))
        assert [r["instance_id"] for r in later] == ["next", "next"]
        deadline = time.monotonic() + 20
        while c.dropped_late < 2 and time.monotonic() < deadline:
            c.gather(c.submit([task("flush")], n=1, deadline_s=60))
            time.sleep(0.2)
        assert c.dropped_late == 2
        arr = collate(res)
        assert arr["status"].sum() == 2


def test_deadline_raise_mode(gw):
    with BatchClient(gw, poll_wait_s=0.2) as c:
        b = c.submit([task("slow", run_s=30.0)], n=1, deadline_s=0.5)
        with pytest.raises(GatewayTimeout):
            c.gather(b, on_deadline="raise")
        c.cancel(b.job_ids)


def test_interleaved_batches_are_kept_apart(gw):
    with BatchClient(gw, poll_wait_s=0.2) as c:
        a = c.submit([task("a", run_s=0.0)], n=4)
        b = c.submit([task("b", run_s=0.3)], n=4)
        time.sleep(0.5)
        rb = c.gather(b)      # a's results arrive while gathering b: kept for a
        ra = c.gather(a)
        assert {r["instance_id"] for r in rb} == {"b"} and {r["instance_id"] for r in ra} == {"a"}
        assert len(rb) == len(ra) == 4


def test_lost_jobs_become_failed_placeholders(gw):
    """A job the gateway does not know (e.g. it restarted without a journal) never hangs a gather."""
    with BatchClient(gw, poll_wait_s=0.1) as c:
        fake = 10**9
        b = Batch(job_ids=[fake], instance_ids=["ghost"], n=[1], handlers=["synthetic"], deadline=None)
        with c._lock:
            c._outstanding.add(fake)       # as if submitted: the gateway reports nothing pending for it
        (r,) = c.gather(b)
        assert r["status"] == "failed" and r["error"]["type"] == "JobLost" and r["instance_id"] == "ghost"
        # ids this client never submitted cannot arrive either
        b = Batch(job_ids=[fake + 1], instance_ids=["other"], n=[1], handlers=["synthetic"], deadline=None)
        (r,) = c.gather(b)
        assert r["error"]["type"] == "JobLost"


def test_async_gather_and_coalesced_submits(gw):
    async def main():
        async with BatchClient(gw, poll_wait_s=0.2) as c:
            calls = []
            orig = c._ctl.submit

            def counting(*a, **kw):
                calls.append(len(a[0]))
                return orig(*a, **kw)

            c._ctl.submit = counting
            # many concurrent one-sample rollouts (what veRL's agent loop does) -> few submit requests
            res = await asyncio.gather(*(c.arollout(task(f"x{i}", run_s=0.01 * (i % 3))) for i in range(24)))
            assert [r["instance_id"] for r in res] == [f"x{i}" for i in range(24)]
            assert sum(calls) == 24 and len(calls) <= 3, calls
            # two batches gathered concurrently, one async generator each
            b1 = await c.asubmit([task("p", run_s=0.2)], n=3)
            b2 = await c.asubmit([task("q")], n=5)
            r1, r2 = await asyncio.gather(c.agather(b1), c.agather(b2))
            assert [r["instance_id"] for r in r1] == ["p"] * 3 and [r["instance_id"] for r in r2] == ["q"] * 5
            # deadline in async mode
            b3 = await c.asubmit([task("slow", run_s=30.0)], n=2, deadline_s=1.0)
            got = [r async for r in c.aresults(b3)]
            assert [r["status"] for r in got] == ["timeout", "timeout"]

    asyncio.run(asyncio.wait_for(main(), 90))


# -- whole groups: over-provisioning and dynamic sampling ---------------------------------------
def job_ids_of(groups):
    return {t["job_id"] for g in groups for t in g}


def accounted(res):
    """Every submitted job is in exactly one place."""
    parts = [job_ids_of(res.groups), job_ids_of(res.rejected), job_ids_of(res.surplus),
             {t["job_id"] for t in res.partial}, set(res.cancelled)]
    assert sum(len(p) for p in parts) == len(set().union(*parts)) == res.submitted_jobs, parts


def test_overprovision_keeps_the_first_complete_groups_and_cancels_exactly_the_rest(gw):
    with BatchClient(gw, poll_wait_s=0.2) as c:
        # four quick groups, two stuck ones (they would take 60 s)
        tasks = [task(f"fast{k}", run_s=0.02) for k in range(4)] + [task(f"slow{k}", run_s=60.0) for k in range(2)]
        res = c.overprovision(tasks, n=2, want=4, extra=0.5, deadline_s=120)
        assert res.submitted_groups == 6 and res.submitted_jobs == 12 and not res.timed_out
        assert sorted(g[0]["instance_id"] for g in res.groups) == [f"fast{k}" for k in range(4)]
        assert all(len(g) == 2 and [t["sample_index"] for t in g] == [0, 1] for g in res.groups)
        assert len(res.cancelled) == 4 and res.partial == [] and res.surplus == []
        assert set(res.cancel_outcome) == set(res.cancelled)
        assert set(res.cancel_outcome.values()) <= {"cancelling", "cancelled"}
        accounted(res)
        # the cancelled jobs really stop: their late results come back cancelled and are acknowledged
        # at once, in the background (so asked again, the gateway may no longer know them)
        deadline = time.monotonic() + 60
        while c.dropped_late < 4 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert c.late_statuses == {"cancelled": 4}, c.late_statuses
        assert set(c.cancel(res.cancelled).values()) <= {"cancelled", "not_found", "already_finished"}
        with pytest.raises(ValueError, match="tasks for want"):
            c.overprovision(tasks[:2], n=2, want=4)


def test_dynamic_sample_refills_until_enough_groups_pass(gw):
    with BatchClient(gw, poll_wait_s=0.2) as c:
        tasks = (task(f"{'good' if k % 3 == 0 else 'flat'}{k}", run_s=0.01) for k in range(30))
        res = c.dynamic_sample(tasks, n=2, want=3, accept=lambda g: g[0]["instance_id"].startswith("good"))
        assert len(res.groups) == 3 and all(g[0]["instance_id"].startswith("good") for g in res.groups)
        assert res.rejected and all(g[0]["instance_id"].startswith("flat") for g in res.rejected)
        # refill: exactly one new group per rejected one
        assert res.submitted_groups == 3 + len(res.rejected)
        accounted(res)
        # the source runs dry: returns what it has, not a hang
        res = c.dynamic_sample([task(f"flat{k}", run_s=0.01) for k in range(4)], n=2, want=2,
                               accept=lambda g: False)
        assert res.groups == [] and len(res.rejected) == 4 and not res.timed_out and res.cancelled == []
        accounted(res)


def test_dynamic_sample_deadline_cancels_everything_outstanding(gw):
    with BatchClient(gw, poll_wait_s=0.2) as c:
        tasks = [task("quick", run_s=0.01)] + [task(f"stuck{k}", run_s=60.0) for k in range(2)]
        res = c.dynamic_sample(tasks, n=2, want=2, inflight=3, accept=lambda g: True, deadline_s=1.5)
        assert res.timed_out and [g[0]["instance_id"] for g in res.groups] == ["quick"]
        assert len(res.cancelled) == 4 and set(res.cancel_outcome) == set(res.cancelled)
        accounted(res)


def test_has_reward_variance():
    from rolloutd.gateway.batch import has_reward_variance

    ok = lambda r: {"status": "ok", "reward": r}  # noqa: E731
    assert has_reward_variance([ok(0.0), ok(1.0)])
    assert not has_reward_variance([ok(1.0), ok(1.0), ok(1.0)])
    assert not has_reward_variance([ok(1.0), {"status": "failed", "reward": 0.0}])  # failures do not count
    assert not has_reward_variance([ok(0.5)])
