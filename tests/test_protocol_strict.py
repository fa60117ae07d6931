"""The protocol as strict as docs/PROTOCOL.md says (issue 13 items 1-4, 6, 17).

Message checks run in-process (bus/messages.py is the one place that decides); everything
else goes through a real ``rolloutd up`` over its real socket.
"""
from __future__ import annotations

import subprocess
import sys
import time

import pytest

from rolloutd.bus.messages import PROTOCOL_VERSION, MessageError, from_wire
from tests.conftest import REPO, synthetic, wait_for


# ---- validation: required fields, exact types, texts that name the real type ------------------
TASK = {"handler": "synthetic", "instance": {}}

REFUSED = [
    ("submit without client_id", {"kind": "submit", "tasks": [TASK]}, "invalid", "submit.client_id is required"),
    ("submit with empty client_id", {"kind": "submit", "client_id": "", "tasks": [TASK]}, "invalid", "client_id must not be empty"),
    ("poll without client_id", {"kind": "poll", "after": 0}, "invalid", "poll.client_id is required"),
    ("task without instance", {"kind": "submit", "client_id": "c", "tasks": [{"handler": "synthetic"}]}, "invalid",
     "submit.tasks[0].instance is required (map)"),
    ("instance_id as int", {"kind": "submit", "client_id": "c", "tasks": [dict(TASK, instance_id=5)]}, "invalid",
     "submit.tasks[0].instance_id: expected string or null, got an int"),
    ("idempotency_key as int", {"kind": "submit", "client_id": "c", "tasks": [TASK], "idempotency_key": 5}, "invalid",
     "submit.idempotency_key: expected string or null, got an int"),
    ("job id a string", {"kind": "cancel", "job_ids": [1, "2"]}, "invalid",
     "cancel.job_ids: expected list of int, got a list with a string at [1]"),
    ("tasks not maps", {"kind": "submit", "client_id": "c", "tasks": [1]}, "invalid",
     "submit.tasks: expected list of map, got a list with an int at [0]"),
    ("after a float", {"kind": "poll", "client_id": "c", "after": 1.5}, "invalid", "poll.after: expected int, got a number (1.5)"),
    ("n a bool", {"kind": "submit", "client_id": "c", "tasks": [dict(TASK, n=True)]}, "invalid",
     "submit.tasks[0].n: expected int, got a bool"),
    ("unknown phase limit", {"kind": "submit", "client_id": "c", "tasks": [dict(TASK, phase_timeouts={"warmup": 1})]},
     "invalid", "unknown phase 'warmup'"),
    ("negative phase limit", {"kind": "submit", "client_id": "c", "tasks": [dict(TASK, phase_timeouts={"run": -1})]},
     "invalid", "phase_timeouts.run: expected a finite number > 0"),
    # Issue 28 item 2: NaN and the infinities are refused, the field named (NaN ran as a 0 s budget).
    ("timeout_s NaN", {"kind": "submit", "client_id": "c", "tasks": [dict(TASK, timeout_s=float("nan"))]}, "invalid",
     "submit.tasks[0].timeout_s: expected number or null, got a number (nan): NaN and infinities are refused"),
    ("timeout_s inf", {"kind": "submit", "client_id": "c", "tasks": [dict(TASK, timeout_s=float("inf"))]}, "invalid",
     "submit.tasks[0].timeout_s: expected number or null, got a number (inf)"),
    ("phase limit NaN", {"kind": "submit", "client_id": "c", "tasks": [dict(TASK, phase_timeouts={"run": float("nan")})]},
     "invalid", "submit.tasks[0].phase_timeouts.run: expected a finite number > 0, got nan"),
    ("phase limit inf", {"kind": "submit", "client_id": "c", "tasks": [dict(TASK, phase_timeouts={"eval": float("inf")})]},
     "invalid", "submit.tasks[0].phase_timeouts.eval: expected a finite number > 0, got inf"),
    ("wait_s NaN", {"kind": "poll", "client_id": "c", "wait_s": float("nan")}, "invalid", "poll.wait_s: expected number"),
    ("weight NaN", {"kind": "add_llm_server", "address": "http://h:1", "weight": float("nan")}, "invalid",
     "add_llm_server.weight: expected number, got a number (nan)"),
    ("weight -inf", {"kind": "add_llm_server", "address": "http://h:1", "weight": float("-inf")}, "invalid",
     "add_llm_server.weight: expected number, got a number (-inf)"),
    ("address without a host", {"kind": "add_llm_server", "address": "http://"}, "invalid", "'http://' has no host"),
    ("address with only a port", {"kind": "add_llm_server", "address": "http://:8000"}, "invalid", "has no host"),
    ("address with a bad port", {"kind": "add_llm_server", "address": "http://h:99999"}, "invalid", "is not a valid URL"),
    ("address not http", {"kind": "add_llm_server", "address": "ftp://h"}, "invalid", "must be an http(s) URL"),
    ("shard below -1", {"kind": "add_llm_server", "address": "http://h:1", "shard": -2}, "invalid",
     "add_llm_server.shard must be -1 (by address) or a shard number >= 0, got -2"),
    ("shard not an int", {"kind": "add_llm_server", "address": "http://h:1", "shard": "1"}, "invalid",
     "add_llm_server.shard"),
    ("binary key in an instance", {"kind": "submit", "client_id": "c", "tasks": [dict(TASK, instance={"a": [{b"k": 1}]})]},
     "invalid", "submit.tasks[0].instance.a[0]: map keys must be strings, got binary data key b'k'"),
]


@pytest.mark.parametrize("name,body,code,text", REFUSED, ids=[r[0] for r in REFUSED])
def test_fields_are_checked_as_the_spec_says(name, body, code, text):
    with pytest.raises(MessageError) as e:
        from_wire(dict(body, v=1))
    assert e.value.code == code
    assert text in e.value.message, e.value.message
    # The class of bad texts the issue found: a typing name, or the same name twice.
    assert "Optional" not in e.value.message and "expected list, got list" not in e.value.message


@pytest.mark.parametrize("v", [1.0, True, "1", None])
def test_version_must_be_the_int(v):
    with pytest.raises(MessageError) as e:
        from_wire({"v": v, "kind": "status"})
    assert e.value.code == "bad_version" and "must be the int 1" in e.value.message


def test_optional_fields_take_their_documented_defaults():
    msg = from_wire({"v": PROTOCOL_VERSION, "kind": "submit", "client_id": "c", "tasks": [TASK]})
    assert msg.idempotency_key is None and msg.req_id == 0
    poll = from_wire({"v": PROTOCOL_VERSION, "kind": "poll", "client_id": "c"})
    assert (poll.after, poll.max_results, poll.wait_s) == (0, 256, 0.0)


# ---- the live gateway -----------------------------------------------------------------------------
def test_poll_cannot_acknowledge_what_it_never_delivered(shared_up, raw):
    """Item 1: after beyond the last delivered sequence number is refused, and drops nothing."""
    with shared_up.client() as c:
        before = c.status()["done_unacked"]
        ids = c.submit([synthetic(i) for i in range(3)])
        wait_for(lambda: c.status()["done_unacked"] >= before + 3, what="three results ready")
        # Three results are ready but no reply has carried any: acknowledging 2 must fail.
        bad = raw.ask_body({"kind": "poll", "client_id": c.client_id, "after": 2})
        assert bad["kind"] == "error" and bad["code"] == "invalid", bad
        assert "beyond the last sequence number delivered" in bad["message"]
        assert c.status()["done_unacked"] == before + 3  # nothing was dropped
        got = c.poll(max_results=100)
        assert sorted(r["job_id"] for r in got) == sorted(ids) and c.after == 3
        bad = raw.ask_body({"kind": "poll", "client_id": c.client_id, "after": 4})
        assert bad["kind"] == "error" and bad["code"] == "invalid", bad
        assert c.poll() == []  # acknowledging what was delivered is fine
        assert c.status()["done_unacked"] == before
    unknown = raw.ask_body({"kind": "poll", "client_id": "never-submitted", "after": 1})
    assert unknown["kind"] == "error" and unknown["code"] == "invalid", unknown


def cancel(c, job_ids) -> dict:
    from rolloutd.bus.messages import Cancel

    return c.request(Cancel(job_ids=list(job_ids)))


def test_cancel_is_idempotent_and_names_the_outcome(shared_up):
    """Item 2: a retried cancel gives the same answer; the reply says what the job ends as."""
    with shared_up.client() as c:
        (done,) = c.submit([synthetic(1, reward=0.5)])
        (finished,) = list(c.gather([done], timeout_s=30))
        assert finished["status"] == "ok"
        c.pause()
        try:
            (queued,) = c.submit([synthetic(2)])
            first = cancel(c, [queued, done, 987654321])
            again = cancel(c, [queued, done, 987654321])
        finally:
            c.resume()
        assert first["jobs"] == again["jobs"] == {str(queued): "cancelled", str(done): "already_finished",
                                                 "987654321": "not_found"}
        assert first["outcome"] == again["outcome"] == {str(queued): "cancelled", str(done): "ok"}
        (long_job,) = c.submit([synthetic(3, run={"dist": "constant", "value": 30})])
        wait_for(lambda: c.status()["dispatched"] == 1, what="the job in flight")
        assert c.cancel([long_job]) == {str(long_job): "cancelling"}
        assert c.cancel([long_job])[str(long_job)] in ("cancelling", "cancelled")
        results = {r["job_id"]: r for r in c.gather([queued, long_job], timeout_s=30)}
        assert results[long_job]["status"] == "cancelled" and results[queued]["status"] == "cancelled"


def test_default_instance_id_is_unique_per_task_across_submits(shared_up):
    """Item 3: tasks without instance_id never share one, within a submit or across submits."""
    with shared_up.client() as c:
        a = c.submit([{"handler": "synthetic", "instance": {}}] * 2, n=2)
        b = c.submit([{"handler": "synthetic", "instance": {}}] * 2, n=2)
        results = {r["job_id"]: r for r in c.gather(a + b, timeout_s=30)}
    iids = [results[j]["instance_id"] for j in a + b]
    # n samples of one task share the id; four tasks, four ids.
    assert iids[0] == iids[1] and iids[2] == iids[3] and iids[4] == iids[5] and iids[6] == iids[7]
    assert len(set(iids)) == 4, iids
    assert all(i.startswith("auto-") for i in iids)


def test_status_backends_follow_add_and_clear_at_once(shared_up):
    """Item 6: status.backends matches list_llm_servers right after each change."""
    url = "http://127.0.0.1:9/"  # nothing listens there; registration does not need a live backend
    with shared_up.client() as c:
        try:
            c.add_backend(url)
            assert [b["address"] for b in c.status()["backends"]] == [b["address"] for b in c.list_backends()["backends"]]
            assert url.rstrip("/") in {b["address"].rstrip("/") for b in c.status()["backends"]}
            # Let a router heartbeat carry the backend too, then clear: the stale view must not linger.
            wait_for(lambda: any(d["daemon"] == "router" and d.get("backends") for d in c.status()["daemons"]),
                     what="a router heartbeat listing the backend")
            c.clear_backends()
            assert c.status()["backends"] == [] == c.list_backends()["backends"]
            c.add_backend(url)
            assert len(c.status()["backends"]) == 1
        finally:
            c.clear_backends()
        assert c.status()["backends"] == []


def test_status_reports_versions_and_counts_malformed_requests(shared_up, raw):
    from rolloutd import __version__

    with shared_up.client() as c:
        st = c.status()
        assert st["version"] == __version__ and st["protocol"] == PROTOCOL_VERSION
        before = st["malformed"].get("requests", 0)
        raw.sock.send_multipart([b"", b"\xc1not msgpack"])
        assert raw.sock.poll(5000)
        raw.sock.recv_multipart()
        assert c.status()["malformed"]["requests"] == before + 1


@pytest.mark.parametrize("instance,key", [({"reward": float("nan")}, "reward"), ({"run": float("inf")}, "run"),
                                          ({"eval": {"dist": "constant", "value": float("nan")}}, "eval.value")])
def test_synthetic_refuses_non_finite_numbers(shared_up, instance, key):
    """Issue 28 item 2, inside a handler: a NaN reward reached the trainer as the result's reward."""
    with shared_up.client() as c:
        r = c.rollout("synthetic", instance, timeout_s=30)
    assert r["status"] == "failed" and r["failed_phase"] == "init", r["status"]
    assert r["error"]["type"] == "SyntheticInstanceError" and f"instance {key} is" in r["error"]["message"]


def test_synthetic_refuses_unknown_instance_keys(shared_up):
    with shared_up.client() as c:
        r = c.rollout("synthetic", {"rnu": 1.0}, timeout_s=30)
    assert r["status"] == "failed" and r["failed_phase"] == "init"
    assert r["error"]["type"] == "SyntheticInstanceError" and "rnu" in r["error"]["message"]


# ---- the CLI with nobody listening (item 17) --------------------------------------------------------
@pytest.mark.parametrize("argv", [["status"], ["cancel", "1"], ["backend", "list"]])
def test_cli_without_a_gateway_says_so_in_one_line(tmp_path, argv):
    for where in (["--runtime-dir", str(tmp_path)], ["--gateway", "tcp://127.0.0.1:9"]):
        # With --timeout 10 the old client tried 4 x 10 s; the probe gives up after 3 s, so the
        # subprocess timeout (30 s, generous for a loaded machine) only trips on the old behaviour.
        p = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", *argv, *where, "--timeout", "10"],
                           capture_output=True, text=True, timeout=30, cwd=REPO)
        assert p.returncode == 3, (p.returncode, p.stderr)
        lines = p.stderr.strip().splitlines()
        assert len(lines) == 1 and "Traceback" not in p.stderr, p.stderr
        assert "no gateway answers at" in lines[0] and "rolloutd up" in lines[0]


def test_cli_status_prints_versions(shared_up):
    from rolloutd import __version__
    import json

    p = subprocess.run([sys.executable, "-m", "rolloutd.daemons.cli", "status", "--gateway", shared_up.gateway],
                       capture_output=True, text=True, timeout=60, cwd=REPO)
    assert p.returncode == 0, p.stderr
    st = json.loads(p.stdout)
    assert st["version"] == __version__ and st["protocol"] == PROTOCOL_VERSION
