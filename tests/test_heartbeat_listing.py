"""Heartbeats that list changes instead of every held job (issue 16, docs/PROTOCOL.md).

The listing rules (events.HeldJobs) on their own, then a real ``rolloutd up`` forced to send
changes only (``daemon.full_listing_max=0``, a full listing only every 60 s) with a lease
timeout shorter than the jobs: the gateway must keep jobs alive from a holder's rebuilt set
(a job listed once and never removed), not only from the jobs a heartbeat names. Without
the per-holder renewal (``Gateway._sweep_leases``) the jobs are re-dispatched at the lease
timeout (checked by disabling the call: the lease test fails with 12 re-dispatches for 6 jobs).
"""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import pytest
import zmq

from rolloutd.bus import codec, events
from rolloutd.bus.messages import PROTOCOL_VERSION
from rolloutd.gateway.client import GatewayTimeout, RolloutClient

from tests.conftest import REPO, remove_tree, short_tmpdir, stop_daemons, synthetic, wait_for


def hb(**fields):
    return [b"daemon.heartbeat", codec.pack(dict({"daemon": "run", "node": "n1"}, **fields))]


def test_changes_rebuild_the_set_and_a_gap_invalidates_it_until_a_full_listing():
    t = events.HeldJobs("inc-1")
    assert t.apply(events.parse(hb(jobs=[[1, 1], [2, 1]], jobs_seq=1))[1]) == [[1, 1], [2, 1]]
    assert t.apply(events.parse(hb(jobs_added=[[3, 1]], jobs_removed=[[1, 1]], jobs_seq=2))[1]) == [[3, 1]]
    assert t.jobs == {2: 1, 3: 1} and t.valid
    # A removal of another attempt does not remove the current one.
    t.apply(events.parse(hb(jobs_added=[], jobs_removed=[[2, 7]], jobs_seq=3))[1])
    assert t.jobs == {2: 1, 3: 1}
    # seq 4 was dropped on the stream: the set is stale until the next full listing.
    assert t.apply(events.parse(hb(jobs_added=[[9, 1]], jobs_removed=[], jobs_seq=5))[1]) is None
    assert not t.valid and 9 not in t.jobs
    assert t.apply(events.parse(hb(jobs_added=[[9, 1]], jobs_removed=[], jobs_seq=6))[1]) is None
    assert t.apply(events.parse(hb(jobs=[[9, 1]], jobs_seq=7))[1]) == [[9, 1]]
    assert t.valid and t.jobs == {9: 1}


def test_malformed_listings_are_not_events():
    assert events.parse(hb(jobs_added=[[1, 1]], jobs_removed=[])) is None            # no jobs_seq
    assert events.parse(hb(jobs_added=[[1, "1"]], jobs_removed=[], jobs_seq=2)) is None
    assert events.parse(hb(jobs_removed=[1], jobs_seq=2)) is None
    assert events.parse(hb(jobs=[[1, 1]], jobs_added=[[2, 1]], jobs_seq=2)) is None  # both at once
    assert events.parse(hb(jobs=[[1, 1]], jobs_seq="2")) is None
    assert events.parse(hb(jobs=[[1, 1]])) is not None                                 # the old form


def test_jobs_outliving_the_lease_are_not_redispatched_when_heartbeats_carry_changes(up_factory):
    up = up_factory("daemon.full_listing_max=0", "daemon.full_listing_s=60", "gateway.lease_timeout_s=3",
                    "run.pool=4")
    with up.client() as c:
        ids = c.submit([synthetic(i, run={"dist": "constant", "value": 6.0}) for i in range(6)])
        results = c.gather(ids, timeout_s=120)
        assert sorted(r["job_id"] for r in results) == sorted(ids)
        assert all(r["status"] == "ok" and r["attempts"] == 1 for r in results), [
            (r["job_id"], r["status"], r["attempts"]) for r in results]
        assert c.status()["totals"].get("redispatched", 0) == 0, (
            up.logged("job_redispatched"), up.logged("heartbeat_gap"), up.logged("daemon_presumed_dead"))


def test_a_killed_holder_listed_by_changes_has_its_jobs_redispatched(up_factory):
    """Re-dispatch on holder death: the gateway knows what the dead run daemon held from its
    rebuilt set, and every job still completes exactly once."""
    up = up_factory("daemon.full_listing_max=0", "daemon.full_listing_s=60", "run.pool=4")
    with up.client() as c:
        ids = c.submit([synthetic(i, run={"dist": "constant", "value": 3.0}) for i in range(6)])
        with events.Subscriber(up.events, ["daemon.heartbeat"]) as sub:
            while True:  # until a change-only heartbeat of run lists something
                ev = sub.next(30)
                assert ev is not None, "no heartbeat"
                if ev[1].get("daemon") == "run" and ev[1].get("jobs_added"):
                    pid = ev[1]["pid"]
                    break
        os.kill(pid, signal.SIGKILL)
        results = c.gather(ids, timeout_s=180)
        assert sorted(r["job_id"] for r in results) == sorted(ids)
        assert all(r["status"] == "ok" for r in results), [(r["job_id"], r["status"]) for r in results]
        assert c.status()["totals"].get("redispatched", 0) >= 1


# ---- a simulated holder against the real head daemons ---------------------------------------------
# The races below depend on when heartbeats arrive relative to the gateway's lease sweep, which
# real phase daemons do not let a test choose. So the real events, router and gateway daemons run
# (as the Slurm launcher starts them), and the test plays the worker node's init and eval daemons
# with the exact wire formats: it takes jobs over the init credit hand-off and publishes their
# heartbeats on a schedule it controls.
NOTHING = {"jobs_added": [], "jobs_removed": []}  # a change listing with no change


class Head:
    def __init__(self, *sets: str):
        self.dir = short_tmpdir("hb-")
        self.run = self.dir / "run"
        self.procs, self.logs = [], []
        for name in ("events", "router", "gateway"):
            log = open(self.dir / f"{name}.log", "w")  # noqa: SIM115 - closed in stop()
            self.logs.append(log)
            cmd = [sys.executable, "-m", "rolloutd.daemons.cli", name, "--runtime-dir", str(self.run)]
            for s in ("gateway.daemon_dead_s=60", *sets):
                cmd += ["--set", s]
            self.procs.append(subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, cwd=REPO,
                                               env=dict(os.environ, PYTHONUNBUFFERED="1")))
        self.gateway = f"ipc://{self.run}/gateway.sock"
        self.ctx = zmq.Context()
        self.pub = self.ctx.socket(zmq.PUB)
        self.pub.connect(f"ipc://{self.run}/events_in.sock")
        self.sub = self.ctx.socket(zmq.SUB)
        for t in (b"control.", b"job.redispatched"):
            self.sub.setsockopt(zmq.SUBSCRIBE, t)
        self.sub.connect(f"ipc://{self.run}/events_out.sock")
        self.seq = {}
        self.seen: list[tuple[str, dict]] = []

    def body(self, daemon: str, inc: str = "i1", **listing) -> dict:
        """The next heartbeat body of ``daemon``@sim (its ``jobs_seq`` counted)."""
        self.seq[daemon] = self.seq.get(daemon, 0) + 1
        return {"daemon": daemon, "node": "sim", "pid": 1, "incarnation": inc, "ts": time.time(),
                "phase": daemon, "pool": 4, "inflight": 0, "counts": {}, "jobs_seq": self.seq[daemon], **listing}

    def beat(self, daemon: str, inc: str = "i1", skip: bool = False, **listing):
        """One heartbeat of ``daemon``@sim (``skip``: count it but never send it: a dropped one)."""
        body = self.body(daemon, inc, **listing)
        if not skip:
            self.pub.send_multipart([b"daemon.heartbeat", codec.pack(body)])

    def pump(self, seconds: float, beats: dict):
        """Heartbeats every 0.25 s for ``seconds``: ``beats`` maps a daemon to its listing kwargs
        (a callable is asked each time); events from the stream are collected meanwhile."""
        end = time.monotonic() + seconds
        while True:
            for d, listing in beats.items():
                self.beat(d, **(listing() if callable(listing) else listing))
            while self.sub.poll(0):
                topic, body = self.sub.recv_multipart()
                self.seen.append((topic.decode(), codec.unpack(body)))
            if time.monotonic() >= end:
                return
            time.sleep(min(0.25, max(0.0, end - time.monotonic())))

    def take_jobs(self, n: int, timeout_s: float = 30.0) -> list[list[int]]:
        """Jobs from the gateway's init hand-off, as an init daemon takes them."""
        inbox = self.ctx.socket(zmq.DEALER)
        inbox.setsockopt(zmq.IDENTITY, b"init@sim#i1")
        inbox.setsockopt(zmq.LINGER, 0)
        inbox.connect(f"ipc://{self.run}/init.sock")
        got = []
        deadline = time.monotonic() + timeout_s
        try:
            while len(got) < n:
                assert time.monotonic() < deadline, f"the gateway handed over {len(got)} of {n} jobs"
                inbox.send(codec.pack({"v": PROTOCOL_VERSION, "kind": "ready", "free": n - len(got),
                                       "received": len(got), "info": {"node": "sim"}}))
                if inbox.poll(300):
                    h = codec.unpack(inbox.recv_multipart()[0])
                    got.append([h["job_id"], h["attempt"]])
            inbox.send(codec.pack({"v": PROTOCOL_VERSION, "kind": "ready", "free": 0, "received": len(got),
                                   "info": {"node": "sim"}}))
        finally:
            inbox.close()
        return got

    def hold_one_job(self, client, others=()) -> list[int]:
        """Submit one job, take it as init@sim and name it in init's full listing (the daemons in
        ``others`` list nothing so far)."""
        client.submit([synthetic(0)])
        [job] = self.take_jobs(1)
        self.pump(0.5, {d: {"jobs": []} for d in ("init", *others)})
        self.beat("init", jobs=[job])
        return job

    def redispatched(self) -> list[dict]:
        return [b for t, b in self.seen if t == "job.redispatched"]

    def one_redispatch(self) -> dict:
        got = self.redispatched()
        assert len(got) == 1, f"expected the job re-dispatched once by its lease, got {got}"
        return got[0]

    def stop(self):
        self.pub.close(0)
        self.sub.close(0)
        self.ctx.term()
        stop_daemons(self.procs)
        for f in self.logs:
            f.close()
        out = "".join((self.dir / f"{n}.log").read_text(errors="replace")[-2000:] for n in ("gateway",))
        remove_tree(self.dir)
        return out


@pytest.fixture
def head():
    made = []

    def make(*sets):
        h = Head(*sets)
        made.append(h)
        wait_for(lambda: _sees(h, {"gateway", "router"}), 60, "head daemons up")
        return h

    yield make
    for h in made:
        h.stop()


def _sees(h: Head, daemons: set) -> bool:
    with RolloutClient(h.gateway, timeout_s=1.0, retries=0) as c:
        try:
            return daemons <= {d.get("daemon") for d in c.status().get("daemons", [])}
        except GatewayTimeout:
            return False


def test_a_job_handed_on_late_in_its_lease_keeps_it_until_the_next_holder_lists_it(head):
    """Lease 3 s; init lists the job once, then only (empty) changes, then removes it 2.8 s after
    the listing; eval names it 1.5 s later (more than a heartbeat: a busy daemon). A lease
    renewed only lazily was nearly spent at the hand-off: the gateway re-dispatched it in the gap
    (checked by disabling the hand-off in Gateway._unvouch: 1 re-dispatch, cause "unseen in any heartbeat")."""
    h = head("gateway.lease_timeout_s=3")
    with RolloutClient(h.gateway) as c:
        job = h.hold_one_job(c, others=("eval",))
        h.pump(2.8, {"init": NOTHING, "eval": {"jobs": []}})
        h.beat("init", jobs_added=[], jobs_removed=[job])
        h.pump(1.5, {"init": NOTHING, "eval": {"jobs": []}})
        h.pump(4.0, {"init": NOTHING, "eval": {"jobs": [job]}})
        assert h.redispatched() == [], h.redispatched()
        # The lease itself still holds: a job no holder lists any more comes back after it.
        h.pump(5.0, {"init": NOTHING, "eval": {"jobs": []}})
        r = h.one_redispatch()
        assert r["job_id"] == job[0] and r["attempt"] == 2 and "unseen in any heartbeat" in r["cause"], r
        assert c.status()["totals"].get("redispatched") == 1


def test_a_holder_silent_for_a_whole_lease_loses_its_jobs_before_it_is_presumed_dead(head):
    """Lease 3 s, daemon_dead_s 60 s: a job its holder's listings vouch for (never touched by the
    sweep while they do) comes back once no complete heartbeat of that holder arrived for a whole
    lease, not when the holder is finally presumed dead (checked by disabling the sweep's
    per-holder check: no re-dispatch within the 7 s)."""
    h = head("gateway.lease_timeout_s=3")
    with RolloutClient(h.gateway) as c:
        job = h.hold_one_job(c, others=("eval",))
        h.pump(4.0, {"init": NOTHING, "eval": {"jobs": []}})
        assert h.redispatched() == [], h.redispatched()
        h.pump(7.0, {"eval": {"jobs": []}})  # init says nothing more
        r = h.one_redispatch()
        assert r["job_id"] == job[0] and "unseen in any heartbeat" in r["cause"], r
        assert any(d["daemon"] == "init" for d in c.status()["daemons"])  # not presumed dead: the lease did it


def test_a_full_listing_that_names_another_attempt_stops_vouching_for_the_current_one(head):
    """The holder's full listings go on naming the job, but with another attempt (a stale
    prefetched copy; found in review): they vouch for nothing the gateway has in flight, so the
    job comes back after the lease (a key-only comparison of the listings left it vouched for
    ever)."""
    h = head("gateway.lease_timeout_s=3")
    with RolloutClient(h.gateway) as c:
        job = h.hold_one_job(c)
        h.pump(1.0, {"init": {"jobs": [job]}})
        assert h.redispatched() == []
        h.pump(6.0, {"init": {"jobs": [[job[0], job[1] + 1]]}})
        r = h.one_redispatch()
        assert r["job_id"] == job[0] and r["attempt"] == job[1] + 1 and "unseen in any heartbeat" in r["cause"], r


def test_a_gap_in_change_listings_makes_the_gateway_ask_for_a_full_one(head):
    """A dropped heartbeat leaves the holder's set unknown; waiting for the next periodic full
    listing (full_listing_s 60 s, which this holder keeps to) would let the 3 s lease expire. The
    gateway publishes control.relist for that holder; answered, the job keeps its lease; ignored,
    the lease still expires (the relist request weakens nothing)."""
    h = head("gateway.lease_timeout_s=3", "daemon.full_listing_s=60")
    with RolloutClient(h.gateway) as c:
        job = h.hold_one_job(c)
        h.pump(1.0, {"init": NOTHING})
        h.beat("init", skip=True, **NOTHING)  # lost on the stream

        asked = []

        def listing():
            if not asked and any(t == "control.relist" for t, _ in h.seen):
                asked.append(1)
                return {"jobs": [job]}
            return NOTHING

        h.pump(6.0, {"init": listing})
        relists = [b for t, b in h.seen if t == "control.relist"]
        assert relists and relists[0]["holder"] == "init" and relists[0]["holder_node"] == "sim", relists
        assert relists[0]["incarnation"] == "i1" and relists[0]["daemon"] == "gateway"
        assert len(relists) == 1, "asked again after the full listing came"
        assert h.redispatched() == [], h.redispatched()

        h.beat("init", skip=True, **NOTHING)
        h.pump(6.0, {"init": NOTHING})  # a holder that never answers
        assert len([1 for t, _ in h.seen if t == "control.relist"]) >= 3  # asked again, once per heartbeat_s at most
        r = h.one_redispatch()
        assert r["job_id"] == job[0] and "unseen in any heartbeat" in r["cause"], r


def test_with_the_default_timings_a_gap_waits_for_the_periodic_full_listing(head):
    """Lease 10 s, full listings every 5 s (the defaults): the periodic listing comes in time, so
    a gap asks for nothing (extra full listings would load an already overloaded stream) and the
    job keeps its lease through it."""
    h = head()
    with RolloutClient(h.gateway) as c:
        job = h.hold_one_job(c)
        h.pump(1.0, {"init": NOTHING})
        h.beat("init", skip=True, **NOTHING)
        h.pump(4.0, {"init": NOTHING})
        h.pump(8.0, {"init": {"jobs": [job]}})  # the periodic full listing, then every heartbeat
        assert [t for t, _ in h.seen if t == "control.relist"] == []
        assert h.redispatched() == [], h.redispatched()


def test_a_phase_daemon_answers_a_relist_request_with_a_full_listing(up_factory):
    """The real run daemon: a control.relist naming it (with its incarnation) makes its next
    heartbeat a full listing; one naming another incarnation changes nothing."""
    up = up_factory("daemon.full_listing_max=0", "daemon.full_listing_s=60", "run.pool=4")
    with up.client() as c, events.Subscriber(up.events, ["daemon.heartbeat"]) as sub:
        ids = c.submit([synthetic(i, run={"dist": "constant", "value": 20.0}) for i in range(3)])

        def next_run_hb():
            while True:
                ev = sub.next(30)
                assert ev is not None, "no heartbeat"
                if ev[1].get("daemon") == "run":
                    return ev[1]

        wait_for(lambda: "jobs" not in next_run_hb(), 60, "a change-only heartbeat of run")
        hb = next_run_hb()
        ctx = zmq.Context()
        pub = ctx.socket(zmq.PUB)
        pub.connect(f"ipc://{up.runtime_dir}/events_in.sock")
        try:
            time.sleep(0.5)  # PUB connects asynchronously; the first sends would be dropped
            base = {"daemon": "gateway", "node": hb["node"], "pid": 1, "ts": time.time(), "holder": "run",
                    "holder_node": hb["node"]}
            pub.send_multipart([b"control.relist", codec.pack(dict(base, incarnation="someone-else"))])
            assert all("jobs" not in next_run_hb() for _ in range(2))
            pub.send_multipart([b"control.relist", codec.pack(dict(base, incarnation=hb["incarnation"]))])
            full = [b for b in (next_run_hb() for _ in range(2)) if "jobs" in b]
            assert full, "no full listing within two heartbeats of the relist request"
        finally:
            pub.close(0)
            ctx.term()
        assert sorted(j for j, _ in full[0]["jobs"]) == sorted(ids)
        assert "jobs" not in next_run_hb()  # and back to changes
        assert len(up.logged("full_listing_requested")) == 1
        c.cancel(ids)


def test_a_holder_heard_only_through_its_nodes_run_daemon_keeps_its_jobs(head):
    """One message per node (docs/EVENTS.md, "Carried heartbeats"): init@sim never publishes; the
    run daemon's heartbeats carry init's, and they alone keep init's job for two leases (3 s) and
    init in the gateway's status. When they stop carrying it, the job comes back by its lease.
    Real events, router and gateway daemons; checked by not calling ``_on_carried``: re-dispatched
    within the first 6 s."""
    h = head("gateway.lease_timeout_s=3")
    with RolloutClient(h.gateway) as c:
        c.submit([synthetic(0)])
        [job] = h.take_jobs(1)
        h.pump(6.0, {"run": lambda: {"jobs": [], "carried": [h.body("init", jobs=[job])]}})
        assert h.redispatched() == [], h.redispatched()
        assert {"run", "init"} <= {d["daemon"] for d in c.status()["daemons"]}
        h.pump(5.0, {"run": {"jobs": []}})  # init's heartbeats no longer arrive
        r = h.one_redispatch()
        assert r["job_id"] == job[0] and "unseen in any heartbeat" in r["cause"], r
