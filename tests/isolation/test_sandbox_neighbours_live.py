"""One job's sandbox cannot fail or re-run its neighbours on the node (issue 38, item 5: a
promise proved until now against the runtime only, not through the daemons). Real ``rolloutd up``
with real bwrap: three hostile jobs (a fork bomb against ``nproc``, a memory grab against
``address_space_mb``, every core busy for the whole call) run beside four neighbours whose
commands must give their exact output, in attempt 1, with no daemon presumed dead.
"""
from __future__ import annotations

from tests.conftest import require_bwrap

HOSTILE = {
    "fork_bomb": "f(){ f | f & }; f; sleep 15",
    "memory": "python3 -c 'a = bytearray(4 << 30)'; python3 -c 'b = [bytearray(1 << 20) for _ in range(4096)]'",
    "cpu": "for i in 1 2 3 4; do (while :; do :; done) & done; sleep 15",
}
NEIGHBOUR = "echo start; sleep 2; seq 1 3; echo end"


def test_hostile_sandboxes_fail_no_neighbour(sandbox_hog_entry_point, up_factory):
    require_bwrap()
    up = up_factory("sandbox.runtime=bwrap", "gateway.daemon_dead_s=10")
    with up.client(timeout_s=30) as c:
        tasks = [{"handler": "sandbox_hog", "instance_id": k, "instance": {"command": cmd, "timeout": 20}, "timeout_s": 90}
                 for k, cmd in HOSTILE.items()]
        tasks += [{"handler": "sandbox_hog", "instance_id": f"n{i}", "timeout_s": 90,
                   "instance": {"command": NEIGHBOUR, "expect": "start\n1\n2\n3\nend\n"}} for i in range(4)]
        ids = c.submit(tasks)
        got = {r["instance_id"]: r for r in c.gather(ids, timeout_s=180)}
    assert len(got) == len(tasks), sorted(got)
    for i in range(4):
        r = got[f"n{i}"]
        assert r["status"] == "ok" and r["reward"] == 1.0 and r["attempts"] == 1, (r["status"], r["error"], r["eval_details"])
    for k in HOSTILE:  # each ends within its budget, whatever it did, and costs no daemon
        assert got[k]["attempts"] == 1 and got[k]["status"] in ("ok", "failed", "timeout"), (k, got[k]["status"], got[k]["error"])
    assert not up.logged("daemon_presumed_dead"), up.logged("daemon_presumed_dead")
    assert not up.logged("job_redispatched")
