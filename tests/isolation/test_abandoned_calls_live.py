"""A client going away cannot leave its tool calls running, through the whole system (issue 38
item 5: SANDBOX.md's "queued and abandoned calls" was proved against the tool server only).

Real ``rolloutd up``, real bwrap, one run slot (``run.pool=1``), the ``tool_queue`` test handler
(tests/isolation/tool_queue.py): a bash and a Python call run ``sleep 1000`` while three more wait
for their tool (the tool server's ping says so), every process tagged in its environment.

* A job cancelled through the gateway, and a job past its run-phase limit: once its result is
  in, not one process of any of its calls is left on the host (foreground, background,
  ``setsid``, queued), and its sandbox is gone.
* A job whose own clients give up on calls (tasks cancelled, a client past its deadline) and that
  goes on in the same sandbox: the queued calls never ran (counted abandoned, none of their files),
  the running ones were interrupted (no tagged process), both tools answer the next call.
* After each, the next job in that run slot gets its exact output in attempt 1.
"""
from __future__ import annotations

import json
import secrets
from pathlib import Path

import pytest

from tests.conftest import destroy_sandboxes, remove_tree, require_bwrap, tagged_pids, traversable_tmpdir, wait_for

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

RUNNING = ("run", "py", "bg", "setsid")  # what the hold job's running calls started


@pytest.fixture(scope="module")
def queue_root():
    d = traversable_tmpdir("rd-tq-")
    yield d
    destroy_sandboxes(d)
    remove_tree(d)


@pytest.fixture(scope="module")
def queue_up(queue_root, tool_queue_entry_point, module_up_factory):
    require_bwrap()
    return module_up_factory("sandbox.runtime=bwrap", f"sandbox.root_dir={queue_root}", "run.pool=1",
                             "gateway.daemon_dead_s=10")


def job(mode: str, tag: str = "", **task) -> dict:
    return dict({"handler": "tool_queue", "instance_id": f"{mode}-{tag}", "instance": {"mode": mode, "tag": tag}}, **task)


def sandbox_dir(root: Path, job_id: int) -> Path | None:
    for st in root.glob("sb/*/state.json"):
        try:
            if str(json.loads(st.read_text())["job_id"]).split(".")[0] == str(job_id):
                return st.parent
        except (OSError, ValueError, KeyError):
            continue
    return None


def results(c, got: dict, want, timeout_s: float = 240.0) -> None:
    def done():
        got.update({r["job_id"]: r for r in c.poll(wait_s=1.0)})
        return all(i in got for i in want)

    wait_for(done, timeout_s=timeout_s, what=f"the results of jobs {list(want)}", interval_s=0)


def hold_until_queued(c, root: Path, jid: int, tag: str, got: dict) -> Path:
    """Wait until the job's three calls wait behind its two running ones, every running process
    is there on the host, and return its sandbox directory."""
    def queued():
        got.update({r["job_id"]: r for r in c.poll()})
        assert jid not in got, (got[jid]["status"], got[jid]["error"])
        d = sandbox_dir(root, jid)
        if d is None or not (d / "workspace" / "all_queued").exists():
            return None
        return d if all(tagged_pids(f"{tag}-{w}") for w in RUNNING) else None

    return wait_for(queued, timeout_s=120, what="the running calls and three queued behind them")


def assert_nothing_left(tag: str, d: Path) -> None:
    """At once, with the result in hand: the job's sandbox is destroyed before its result is sent."""
    left = {}
    for pid in tagged_pids(tag):
        try:
            left[pid] = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            pass  # exited between the scan and the read
    assert left == {}, left
    assert not d.exists(), sorted(p.name for p in d.iterdir())


def next_job_in_the_slot_is_exact(c, got: dict) -> None:
    token = secrets.token_hex(4)
    (jid,) = c.submit([{"handler": "tool_queue", "instance_id": "echo", "instance": {
        "mode": "echo", "command": f"echo {token}; pwd", "expect": f"{token}\n/workspace\n"}}])
    results(c, got, [jid])
    r = got[jid]
    assert r["status"] == "ok" and r["reward"] == 1.0 and r["attempts"] == 1, (r["status"], r["error"], r["eval_details"])


def test_a_job_cancelled_with_calls_running_and_queued_leaves_no_process(queue_up, queue_root):
    tag, got = "tq-" + secrets.token_hex(6), {}
    with queue_up.client(timeout_s=30) as c:
        (jid,) = c.submit([job("hold", tag)])
        d = hold_until_queued(c, queue_root, jid, tag, got)
        assert c.cancel([jid])[str(jid)] in ("cancelling", "cancelled")
        results(c, got, [jid])
        assert got[jid]["status"] == "cancelled" and got[jid]["attempts"] == 1, (got[jid]["status"], got[jid]["error"])
        assert_nothing_left(tag, d)
        next_job_in_the_slot_is_exact(c, got)
    assert not queue_up.logged("job_redispatched")


def test_a_job_timed_out_with_calls_running_and_queued_leaves_no_process(queue_up, queue_root):
    tag, got = "tq-" + secrets.token_hex(6), {}
    with queue_up.client(timeout_s=30) as c:
        # a bound for the calls to start and queue (seconds on a loaded box), then the run phase times out
        (jid,) = c.submit([job("hold", tag, phase_timeouts={"run": 20})])
        d = hold_until_queued(c, queue_root, jid, tag, got)
        results(c, got, [jid])
        r = got[jid]
        assert r["status"] == "timeout" and r["failed_phase"] == "run" and r["attempts"] == 1, (r["status"], r["error"])
        assert_nothing_left(tag, d)
        next_job_in_the_slot_is_exact(c, got)


def test_calls_a_job_gives_up_on_never_run_and_its_sandbox_goes_on(queue_up, queue_root):
    tag, got = "tq-" + secrets.token_hex(6), {}
    with queue_up.client(timeout_s=30) as c:
        (jid,) = c.submit([job("abandon", tag)])
        results(c, got, [jid])
        r = got[jid]
        assert r["status"] == "ok" and r["attempts"] == 1, (r["status"], r["error"])
        d = r["eval_details"]
        # queued: one client past its deadline, two tasks cancelled; then the two running calls cancelled
        assert d["outcomes"] == ["ToolTransportError", "CancelledError", "CancelledError", "CancelledError",
                                 "CancelledError"], d
        assert d["abandoned"] == d["abandoned_after"] == 3 and d["waiting_after"] == {"bash": 0, "python": 0, "editor": 0}, d
        assert d["python"] == "python ok\n" and d["check"] == "checked\n", d  # no LEFT line, no ghost file
        assert r["reward"] == 1.0
        assert tagged_pids(tag) == []
        next_job_in_the_slot_is_exact(c, got)
