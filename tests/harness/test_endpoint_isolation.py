"""One job cannot hurt another through its harness endpoint (issue 31).

Real daemons (``rolloutd up``), real bwrap sandboxes, the tiny model's real tokenizer, a
scripted vLLM-API backend. Neighbour jobs (stdlib agents making small multi-turn calls) run on
the same run daemon while attacker jobs abuse their own endpoints: 8 MB and 60 MB bodies, 200k
nested ``[``, a connection flood, slowloris headers and bodies, HTTP/0.9 and unknown versions,
a 2 MiB header line, an Upgrade head with a body, responses never read. The neighbours must
finish ok in their first attempt, nobody may be presumed dead or re-dispatched, each attacker ends alone with the
refusal it got (failed; graded when its calls were answered: RELIABILITY.md, "No abstention"),
and the run daemon's peak RSS stays within the documented bound.

Latency is measured, not timed: the assertion on the neighbours' p99 is a generous bound (the
2x figure is the benchmark's, bench/bench_endpoint_isolation.py). Wall time: ~90 s.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.harness.conftest import harness_sets
from tests.harness.isolation_agents import ATTACKER, NEIGHBOUR

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

ATTACKS = ("big8", "big60", "nested", "conns", "slow", "noread")
RSS_BOUND_MB = 1500  # peak RSS growth of the run daemon under every attack at once (docs/HARNESS.md)


def neighbour(i: int, seconds: float = 25.0, min_calls: int = 10) -> dict:
    return {"handler": "harness", "instance_id": f"nb{i}", "instance": {
        "command": ["python3", "agent.py", str(seconds), str(min_calls)], "task": "talk", "task_via": "stdin",
        "setup": {"files": {"agent.py": NEIGHBOUR}},
        "limits": {"max_llm_calls": 1000, "wall_s": 300, "max_context": 4096},
        "eval": {"command": ["true"]}}}


def attacker(mode: str) -> dict:
    return {"handler": "harness", "instance_id": f"atk-{mode}", "instance": {
        "command": ["python3", "attack.py", mode], "task": "attack", "task_via": "stdin",
        "setup": {"files": {"attack.py": ATTACKER}},
        "limits": {"max_llm_calls": 1000, "wall_s": 300, "max_context": 4096},
        "eval": {"command": ["true"]}}}


def latencies(r: dict) -> list[float]:
    tail = r["eval_details"]["agent"]["output_tail"]
    m = re.search(r"^LAT (\[.*\])$", tail, re.M)
    assert m, tail[-2000:]
    return json.loads(m.group(1))


def peak_rss_mb(pid: int) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) / 1024
    raise AssertionError("no VmHWM")


@pytest.fixture(scope="module")
def echo_backend(tok_dir):
    from rolloutd.backends.scripted import ScriptedBackend

    b = ScriptedBackend(tok_dir, policy="echo")
    b.start()
    yield b
    b.stop()


@pytest.fixture(scope="module")
def iso_up(module_up_factory, tok_dir, sandbox_root, echo_backend):
    from tests.conftest import require_bwrap

    require_bwrap()
    up = module_up_factory(*harness_sets(tok_dir, sandbox_root, ""), "init.pool=12", "run.pool=12",
                           "eval.pool=12")
    with up.client() as c:
        c.add_backend(echo_backend.url)
    return up


def run_batch(up, tasks, timeout_s=600):
    with up.client() as c:
        ids = c.submit(tasks)
        res = {r["job_id"]: r for r in c.gather(ids, timeout_s=timeout_s)}
    return [res[i] for i in ids]


def test_no_attack_on_one_endpoint_fails_or_slows_the_neighbours(iso_up):
    quiet = run_batch(iso_up, [neighbour(i, seconds=8, min_calls=10) for i in range(3)])
    for r in quiet:
        assert r["status"] == "ok", (r["error"], r["eval_details"].get("agent"))
    base = [x for r in quiet for x in latencies(r)]
    rss0 = peak_rss_mb(iso_up.daemon_pid("run"))

    results = run_batch(iso_up, [neighbour(i) for i in range(4)] + [attacker(m) for m in ATTACKS])
    nbs, atks = results[:4], results[4:]
    redis = iso_up.logged("job_redispatched")
    dead = iso_up.logged("daemon_presumed_dead")
    busy = iso_up.logged("daemon_busy")
    # The run daemon hosts every endpoint: it is never presumed dead, nor even busy (its loop late
    # by 2 heartbeats). Another daemon starved by a machine shared at load ~100 (seen while this
    # was written: eval and the gateway's own heartbeat late by 5-6 s) is not this test's subject:
    # its jobs come back and must still end ok.
    assert not [d for d in dead + busy if d["daemon"].startswith("run@")], (dead, busy)
    assert not [r for r in redis if "run@" in str(r.get("cause"))], redis
    starved = bool(dead)
    for r in nbs:
        assert r["status"] == "ok" and (starved or r["attempts"] == 1), (r["instance_id"], r["error"],
                                                                          r["eval_details"].get("agent"))
    loaded = [x for r in nbs for x in latencies(r)]
    p99_quiet, p99_loaded = float(np.percentile(base, 99)), float(np.percentile(loaded, 99))
    print(f"neighbour p99 quiet {p99_quiet * 1000:.0f} ms, under attack {p99_loaded * 1000:.0f} ms; "
          f"max {max(loaded) * 1000:.0f} ms")
    # Generous: a loaded 2-core CI box. Before the fix one 8 MB body stalled the loop for seconds.
    assert p99_loaded <= max(10 * p99_quiet, 1.5), (p99_quiet, p99_loaded, sorted(loaded)[-10:])
    for r in atks:
        agent = r["eval_details"]["agent"]
        # Each ends alone with exit 3. "noread"'s 64 requests are answered (it never reads them), so
        # its exit is graded, not failed (RELIABILITY.md, "No abstention"); the others got no answer.
        graded = r["instance_id"] == "atk-noread"
        assert r["status"] == ("ok" if graded else "failed") and (starved or r["attempts"] == 1), (
            r["instance_id"], r["status"], r["error"], agent.get("output_tail"))
        assert agent["exit_code"] == 3, (r["instance_id"], agent)
        if graded:
            assert "exit code 3 after" in r["eval_details"]["reason"] and r["turns"], r["eval_details"]
        else:
            assert r["error"]["type"] == "AgentExited", (r["instance_id"], r["error"])
        print(r["instance_id"], agent["output_tail"].strip().splitlines()[-8:])
    tails = {r["instance_id"]: r["eval_details"]["agent"]["output_tail"] for r in atks}
    for big in ("atk-big8", "atk-big60"):  # refused from its Content-Length; the client may see the reset first
        assert re.search(r"ANSWER (HTTP/1.1 413|closed)", tails[big]), tails[big]
    assert re.search(r"ANSWER HTTP/1.1 400", tails["atk-nested"]), tails["atk-nested"]
    # HTTP/0.9 is answered at its first line (it got 408 after 30 s before); the 1 GB Content-Length
    # is refused from the header, before a byte of the body.
    for what, answer in (("headers", "408"), ("body", "413"), ("http09", "400"), ("bigheader", "400|431"),
                         ("version", "505")):
        assert re.search(rf"ANSWER {what} (HTTP/1.1 ({answer})|closed)", tails["atk-slow"]), tails["atk-slow"]
    # an Upgrade head with a body is refused, not served with its body dropped (docs/HARNESS.md)
    assert re.search(r"ANSWER upgrade HTTP/1.1 400 Bad Request code=upgrade_with_body",
                     tails["atk-slow"]), tails["atk-slow"]
    growth = peak_rss_mb(iso_up.daemon_pid("run")) - rss0
    print(f"run daemon peak RSS growth {growth:.0f} MB")
    assert growth < RSS_BOUND_MB, growth
