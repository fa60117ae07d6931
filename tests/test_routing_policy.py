"""The router's lease policy on its own (no sockets)."""
from __future__ import annotations

import random

import pytest

from rolloutd.daemons.routing import NoBackend, Pool


def pool_of(n, policy="least_inflight", **kw):
    p = Pool(policy)
    for i in range(n):
        p.add(f"http://b{i}", **kw)
    return admit_all(p)


def admit_all(p):
    """Every backend passed its first health check."""
    for b in list(p.backends):
        p.mark(b, True)
    return p


def test_least_inflight_balances_random_job_lengths():
    p = pool_of(4)
    rng = random.Random(0)
    live = []
    for t in range(2000):
        if live and rng.random() < 0.5:
            p.release(live.pop(rng.randrange(len(live))).lease_id)
        else:
            before = {b.id: b.inflight for b in p.backends.values()}
            lease = p.lease(t)
            assert before[lease.backend_id] == min(before.values())  # always the least loaded
            live.append(lease)
        loads = [b.inflight for b in p.backends.values()]
        assert sum(loads) == len(live) == len(p.leases)
    for lease in live:
        assert p.release(lease.lease_id)
    assert all(b.inflight == 0 for b in p.backends.values()) and not p.leases
    assert not p.release("L-unknown")


def test_round_robin_ignores_load():
    p = pool_of(2, policy="round_robin")
    long = p.lease(1)                       # backend 0 holds a long job
    for j in range(2, 10):                  # short jobs come and go
        p.release(p.lease(j).lease_id)
    picks = [p.lease(j).backend_id for j in range(10, 14)]
    assert picks.count("http://b0") == 2 and picks[0] != picks[1]  # strict alternation...
    assert p.backends[long.backend_id].inflight == 3  # ...so the busier backend still gets half


def test_capacity_and_weight():
    p = Pool()
    p.add("http://small", capacity=1)
    p.add("http://big", capacity=3)
    admit_all(p)
    got = [p.lease(j) for j in range(4)]
    assert sorted(g.backend_id for g in got) == ["http://big"] * 3 + ["http://small"]
    assert p.lease(5) is None  # every backend at capacity: the caller waits
    p.release(got[0].lease_id)
    assert p.lease(6) is not None


def test_ties_are_broken_fairly():
    p = pool_of(3)
    firsts = set()
    for j in range(6):
        lease = p.lease(j)
        firsts.add(lease.backend_id)
        p.release(lease.lease_id)
    assert len(firsts) == 3


def test_node_affinity_within_threshold():
    p = Pool(node_affinity=0.3)
    p.add("http://far", node="a", capacity=4)
    p.add("http://near", node="b", capacity=4)
    admit_all(p)
    assert p.lease(1, node="b").backend_id == "http://near"   # equal loads: same node wins
    assert p.lease(2, node="b").backend_id == "http://near"   # 0.25 vs 0: within 0.3
    assert p.lease(3, node="b").backend_id == "http://far"    # 0.5 vs 0: too far apart
    assert p.lease(4, node="a").backend_id == "http://far"


def test_unhealthy_and_excluded_are_skipped_and_expiry():
    p = pool_of(2)
    p.mark("http://b0", False)
    assert {p.lease(j).backend_id for j in range(3)} == {"http://b1"}
    # b1 failed this job once, but it is healthy (re-admitted) and the only candidate
    assert p.lease(9, exclude=["http://b1"]).backend_id == "http://b1"
    assert len(p.expire(0.0)) == 4 and p.backends["http://b1"].inflight == 0
    p.clear()
    with pytest.raises(NoBackend):
        p.lease(1)


def test_clear_keeps_live_leases_releasable_and_readd_updates_version():
    p = pool_of(1)
    lease = p.lease(1)
    p.add("http://b0", policy_version=2)
    assert p.backends["http://b0"].policy_version == 2 and p.current_version() == 2
    p.clear()
    assert p.release(lease.lease_id)  # releasing after the backend went is harmless
    p.add("http://b0", policy_version=3)
    p.adopt("Lx", "http://b0", 7, "run@n", 3)
    assert p.backends["http://b0"].inflight == 1


def test_a_backend_is_pending_until_a_check_passes_also_when_registered_again():
    p = Pool()
    b = p.add("http://new")
    assert (b.healthy, b.checked) == (False, False) and b.public()["healthy"] is False
    assert p.lease(1) is None  # registered but never checked: the request waits
    assert p.mark("http://new", True) and b.checked
    lease = p.lease(2)
    assert lease.backend_id == "http://new"
    p.add("http://new", policy_version=5)  # re-registered (e.g. reloaded weights): pending again
    assert (b.healthy, b.checked, b.inflight) == (False, False, 1) and p.lease(3) is None
    p.mark("http://new", True)
    assert p.lease(4).policy_version == 5


def test_exclusion_yields_to_a_readmitted_backend():
    p = pool_of(2)
    p.mark("http://b0", False)                       # b0 failed this job and left rotation
    assert p.lease(1, exclude=["http://b0"]).backend_id == "http://b1"
    p.backends["http://b1"].capacity = 1             # b1 is now full
    assert p.lease(2, exclude=["http://b0"]) is None  # nothing healthy and free: wait
    p.mark("http://b0", True)                        # re-admitted: serves the job that excluded it
    assert p.lease(3, exclude=["http://b0"]).backend_id == "http://b0"
    p.backends["http://b1"].capacity = 0
    assert p.lease(4, exclude=["http://b0"]).backend_id == "http://b1"  # still preferred away from b0


def test_new_leases_go_only_within_the_lag_of_the_newest_version():
    """Issue 27: with v0 and v1 registered and max_policy_lag=0, every new lease is on v1 (before,
    least-inflight spread them over both); the v0 lease already held stays releasable."""
    p = Pool(max_policy_lag=0)
    p.add("http://old", policy_version=0)
    admit_all(p)
    held = p.lease(1)
    assert held.backend_id == "http://old"
    p.add("http://new", policy_version=1)
    assert p.lease(2) is None  # the new version is pending its check: wait for it, not the old one
    admit_all(p)
    assert {p.lease(j).backend_id for j in range(3, 40)} == {"http://new"}
    assert [b.id for b in p.too_old()] == ["http://old"]
    assert p.release(held.lease_id) and p.backends["http://old"].inflight == 0
    # excluded from the new version, the job still may not fall back to the old one
    assert p.lease(50, exclude=["http://new"]).backend_id == "http://new"


def test_rolling_swap_with_lag_one_keeps_old_servers_serving_until_two_behind():
    p = Pool(max_policy_lag=1)
    for i in range(4):
        p.add(f"http://s{i}", policy_version=0)
    admit_all(p)
    p.add("http://s0", policy_version=1)  # s0 reloaded first: v0 is one behind, still within the lag
    admit_all(p)
    assert {p.lease(j).backend_id for j in range(8)} == {f"http://s{i}" for i in range(4)}
    p.add("http://s1", policy_version=2)  # now v0 is two behind: s2, s3 drain
    admit_all(p)
    assert {p.lease(j).backend_id for j in range(8, 40)} == {"http://s0", "http://s1"}
    p.clear("http://s1")  # the newest is gone: v1 is the newest registered again, v0 within the lag
    assert {p.lease(j).backend_id for j in range(40, 80)} == {"http://s0", "http://s2", "http://s3"}


def test_round_robin_respects_the_version_bound():
    p = Pool("round_robin", max_policy_lag=0)
    p.add("http://a", policy_version=3)
    p.add("http://b", policy_version=4)
    admit_all(p)
    assert {p.lease(j).backend_id for j in range(6)} == {"http://b"}
