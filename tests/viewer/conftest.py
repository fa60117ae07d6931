"""Results the viewer is tested on, made by a real ``rolloutd up``: math jobs answered by the oracle
on a scripted vLLM-API backend (groups of two samples, one group always right: zero variance),
a job that fails in init, one that times out in run and one cancelled while it runs."""
from __future__ import annotations

import json

import pytest

from tests.conftest import wait_for


@pytest.fixture(scope="session")
def tok_dir(tmp_path_factory):
    from rolloutd.backends.tiny_model import make_tiny_model

    return str(make_tiny_model(tmp_path_factory.mktemp("view-tok"), tokenizer_only=True))


@pytest.fixture(scope="module")
def results_file(module_up_factory, tok_dir, tmp_path_factory):
    from rolloutd.gateway.records import to_jsonable
    from rolloutd.handlers.oracles import Oracle
    from rolloutd.backends.scripted import ScriptedBackend

    pol = Oracle(wrong_every=2)
    pol.warm()
    backend = ScriptedBackend(tok_dir, policy=pol)
    backend.start()
    try:
        up = module_up_factory("sandbox.runtime=local", "handlers=" + json.dumps({"math": {"tokenizer": tok_dir}}))
        math = [{"handler": "math", "instance_id": f"m{k}", "instance": {"dataset": "chain_sum", "seed": 3, "index": k}}
                for k in range(3)]
        bad = {"handler": "math", "instance_id": "bad", "instance": {"dataset": "no_such_dataset", "seed": 0, "index": 0}}
        slow = {"handler": "synthetic", "instance_id": "slow", "instance": {"run": 30}, "timeout_s": 1.0}
        long = {"handler": "synthetic", "instance_id": "cancel-me", "instance": {"run": 60}}
        with up.client() as c:
            c.add_backend(backend.url)
            results = list(c.gather(c.submit(math, n=2) + c.submit([bad, slow]), timeout_s=120))
            (cid,) = c.submit([long])
            wait_for(lambda: c.status()["dispatched"] >= 1, 60, what="the long job to be dispatched")
            c.cancel([cid])
            results += list(c.gather([cid], timeout_s=60))
        path = tmp_path_factory.mktemp("view") / "results.jsonl"
        path.write_text("".join(json.dumps(to_jsonable(r)) + "\n" for r in results))
        return path
    finally:
        backend.stop()
