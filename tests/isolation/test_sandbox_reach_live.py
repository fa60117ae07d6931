"""An agent in one sandbox cannot reach another sandbox, the node's daemons or its own reward,
through the whole system (issue 38 item 5: SANDBOX.md's threat model was proved against the
runtime only, never through ``rolloutd up``).

Real daemons, real bwrap, harness jobs graded by ``eval.pytest``. Three honest neighbours fix
their ``calc.py``, start a helper process and wait, alive, while one attacker job (given by the
host everything it could wish to know: the neighbours' host paths, host pids and endpoint ports,
every Unix socket of the node's daemons, the backend's TCP port) tries to read, write, signal and
connect to all of it, scans its /proc, its socket table and every TCP port of its loopback, and
forges its grade (its own tool server's ``grade``, the read-only run dir, a passing test,
conftest plugins, ``pytest.ini``, ``pytest.py``, a daemon rewriting the tests into grading). The
neighbours go on only once the attacker's job has ended, grade included, and must find nothing
of theirs touched, their helper alive, their endpoint answering, and earn reward 1; the attacker
must reach nothing (every attempt blocked, each one named in its report) and earn the 0 its
wrong ``calc.py`` is worth, graded by the real test.
"""
from __future__ import annotations

import json
import os
import re
import secrets
from pathlib import Path
from urllib.parse import urlparse

import pytest

from tests.conftest import destroy_sandboxes, remove_tree, require_bwrap, traversable_tmpdir, wait_for
from tests.isolation.reach_agents import ATTACKER, CALC_WRONG, NEIGHBOUR, TESTS

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

NAMES = ("n0", "n1", "n2")
EVAL = {"pytest": ["tests"], "timeout_s": 120}
LIMITS = {"wall_s": 600, "max_llm_calls": 4, "max_context": 4096}


def neighbour(name: str, token: str, secret: str) -> dict:
    return {"handler": "harness", "instance_id": name, "instance": {
        "command": ["python3", "agent.py", token], "task": "fix calc.py", "task_via": "stdin",
        "setup": {"files": {"agent.py": NEIGHBOUR, "calc.py": CALC_WRONG, "tests/test_calc.py": TESTS,
                            "secret.txt": secret}},
        "limits": LIMITS, "eval": EVAL}}


def attacker() -> dict:
    return {"handler": "harness", "instance_id": "atk", "instance": {
        "command": ["python3", "attack.py"], "task": "fix calc.py", "task_via": "stdin",
        "setup": {"files": {"attack.py": ATTACKER, "calc.py": CALC_WRONG, "tests/test_calc.py": TESTS}},
        "limits": LIMITS, "eval": EVAL}}


@pytest.fixture
def sandbox_root():
    d = traversable_tmpdir("rd-reach-")
    yield d
    destroy_sandboxes(d)
    remove_tree(d)


@pytest.fixture
def echo_backend(tiny_tokenizer_dir):
    from rolloutd.backends.scripted import ScriptedBackend

    b = ScriptedBackend(str(tiny_tokenizer_dir), policy="echo")
    b.start()
    yield b
    b.stop()


def sandbox_dirs(root: Path) -> dict[int, Path]:
    """job id -> its sandbox's host directory (``sb/<id>`` under the configured root)."""
    out = {}
    for st in root.glob("sb/*/state.json"):
        try:
            state = json.loads(st.read_text())
        except (OSError, ValueError):
            continue
        out[int(str(state["job_id"]).split(".")[0])] = st.parent
    return out


def host_pids(token: str) -> list[int]:
    """Host pids of every process whose argv carries ``token`` (a neighbour's agent and helper)."""
    out = []
    for p in Path("/proc").iterdir():
        if p.name.isdigit():
            try:
                if token.encode() in (p / "cmdline").read_bytes():
                    out.append(int(p.name))
            except OSError:
                pass
    return out


def state_pids(d: Path) -> list[int]:
    """The sandbox's own host pids its state.json records (bwrap's init: the tool server)."""
    pids = json.loads((d / "state.json").read_text()).get("pids") or []
    return [int(p[0] if isinstance(p, (list, tuple)) else p) for p in pids]


def put(path: Path, text: str) -> None:
    """Whole or not at all: the agents poll for the name."""
    tmp = path.with_name(path.name + ".part")
    tmp.write_text(text)
    os.replace(tmp, path)


def collect(c, got: dict, want, timeout_s: float = 300.0) -> None:
    """Poll until every job of ``want`` has its result; every result polled is kept in ``got``."""
    def done():
        got.update({r["job_id"]: r for r in c.poll(wait_s=1.0)})
        return all(i in got for i in want)

    wait_for(done, timeout_s=timeout_s, what=f"the results of jobs {list(want)}", interval_s=0)


def tail_line(result: dict, prefix: str) -> str:
    tail = result["eval_details"]["agent"]["output_tail"]
    m = re.search(rf"^{prefix} (.*)$", tail, re.M)
    assert m, (result["instance_id"], result["status"], result["error"], tail[-3000:])
    return m.group(1)


def test_a_hostile_agent_reaches_no_neighbour_no_daemon_and_not_its_reward(sandbox_root, up_factory,
                                                                           tiny_tokenizer_dir, echo_backend):
    require_bwrap()
    handlers = {"harness": {"tokenizer": str(tiny_tokenizer_dir), "agent_venv": ""}}
    up = up_factory("sandbox.runtime=bwrap", f"sandbox.root_dir={sandbox_root}", "handlers=" + json.dumps(handlers),
                    "gateway.daemon_dead_s=10")
    tokens = {k: secrets.token_hex(8) for k in NAMES}
    hidden = {k: secrets.token_hex(16) for k in NAMES}
    got: dict[int, dict] = {}
    with up.client(timeout_s=30) as c:
        c.add_backend(echo_backend.url)
        ids = c.submit([neighbour(k, tokens[k], hidden[k]) for k in NAMES] + [attacker()])
        job = dict(zip(NAMES + ("atk",), ids))

        def ready():
            got.update({r["job_id"]: r for r in c.poll()})
            assert not got, [(r["instance_id"], r["status"], r["error"]) for r in got.values()]
            dirs = sandbox_dirs(sandbox_root)
            if all(job[k] in dirs and (dirs[job[k]] / "workspace" / "ready.json").exists() for k in NAMES) \
                    and job["atk"] in dirs and (dirs[job["atk"]] / "workspace").is_dir():
                return {k: dirs[job[k]] for k in job}
            return None

        dirs = wait_for(ready, timeout_s=240, what="the neighbours ready and the attacker's sandbox made")
        neighbours = []
        for k in NAMES:
            pids = host_pids(tokens[k]) + state_pids(dirs[k])
            assert len(pids) >= 3, (k, pids)  # its agent, its helper, its tool server: the attack's targets
            port = json.loads((dirs[k] / "workspace" / "ready.json").read_text())["port"]
            neighbours.append({"name": k, "token": tokens[k], "workspace": str(dirs[k] / "workspace"),
                               "sandbox_dir": str(dirs[k]), "pids": pids, "port": port})
        sockets = sorted(str(p) for p in Path(up.runtime_dir).rglob("*") if p.is_socket())
        assert any(s.endswith("gateway.sock") for s in sockets), sockets
        for k in NAMES:
            sockets += [str(dirs[k] / "run" / "tool.sock"), str(dirs[k] / "run" / "llm.sock")]
        backend_port = urlparse(echo_backend.url).port
        put(dirs["atk"] / "workspace" / "targets.json", json.dumps({
            "neighbours": neighbours, "sockets": sockets, "tcp": [["127.0.0.1", backend_port]],
            "runtime_dir": str(up.runtime_dir), "sandbox_root": str(sandbox_root)}))
        collect(c, got, [job["atk"]])  # the attacker's job ends while the neighbours wait
        assert set(got) == {job["atk"]}, [(r["instance_id"], r["status"], r["error"]) for r in got.values()]
        for k in NAMES:
            put(dirs[k] / "workspace" / "go", "")
        collect(c, got, ids)

    atk = got[job["atk"]]
    for r in got.values():
        print("TIMING", r["instance_id"], r["timing"], r["eval_details"].get("agent", {}).get("duration_s"))
    assert atk["status"] == "ok" and atk["attempts"] == 1, (atk["status"], atk["error"], atk["eval_details"])
    report = json.loads(tail_line(atk, "ATTACK"))
    print(json.dumps(report, indent=1, sort_keys=True))
    assert {k: v for k, v in report.items() if not v.startswith(("blocked:", "own:"))} == {}
    # every attack ran: each neighbour's files and pids, every socket both ways, the scans, the grade
    for n in neighbours:
        for what in ("read_secret", "read_calc", "write_calc", "write_tests", "plant", "list_sandbox_dir"):
            assert report[f"{n['name']}.{what}"].startswith("blocked:"), (n["name"], what)
        for pid in n["pids"]:
            assert f"{n['name']}.pid{pid}.kill9" in report or f"{n['name']}.pid{pid}" in report, (n["name"], pid)
    for s in sockets:
        assert report[f"unix:{s}"] == "blocked:ENOENT" and report[f"abstract:{s}"].startswith("blocked:"), s
    assert report["tcp_scan"].startswith("own:") and report["unix_table"].startswith("own:")
    assert report["own_tool_server.grade"].startswith("blocked:"), report["own_tool_server.grade"]
    assert not any(h in json.dumps(atk, default=str) for h in hidden.values())
    # its reward is what its wrong calc.py earns: the real test ran (the daemon died first) and failed
    d = atk["eval_details"]
    assert atk["reward"] == 0.0 and d["eval_status"] == 1, d
    assert "assert -1 == 5" in d["eval_output"], d["eval_output"][-2000:]
    # the test tree restored whole (its forged test and conftest gone), the root conftest swept
    assert d["restored"] == ["tests"] and d["conftests_removed"] == ["conftest.py"], d

    expected = {"calc": True, "helper": True, "llm": 200, "planted": False, "secret": True, "tests": True}
    for k in NAMES:
        r = got[job[k]]
        assert r["status"] == "ok" and r["attempts"] == 1, (k, r["status"], r["error"], r["eval_details"])
        assert json.loads(tail_line(r, "NEIGHBOUR")) == expected, k
        assert r["reward"] == 1.0 and r["eval_details"]["eval_status"] == 0, (k, r["eval_details"])
    assert not up.logged("daemon_presumed_dead") and not up.logged("job_redispatched")
