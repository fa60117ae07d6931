"""The synthetic handler's ``trace``: each phase's handler start and end on the daemon's monotonic
clock, in ``eval_details.drawn`` (bench_pipeline.py measures the slots' idle gaps between jobs from
them). Real ``rolloutd up``."""
from __future__ import annotations

from tests.conftest import synthetic


def test_a_traced_job_reports_each_phase_span_in_order_and_at_least_its_latency(shared_up):
    with shared_up.client() as c:
        ids = c.submit([dict(synthetic(1, init=0.02, run=0.05, eval=0.01, trace=True), timeout_s=60),
                        dict(synthetic(2, run=0.01), timeout_s=60)])
        got = {r["job_id"]: r for r in c.gather(ids, timeout_s=60)}
    traced, plain = got[ids[0]], got[ids[1]]
    assert traced["status"] == "ok" and plain["status"] == "ok", (traced["error"], plain["error"])
    drawn = traced["eval_details"]["drawn"]
    spans = [drawn[f"{p}_at"] for p in ("init", "run", "eval")]
    for (start, end), latency in zip(spans, (0.02, 0.05, 0.01)):
        assert end - start >= latency, spans  # the handler's own span holds its sleep
    assert spans[0][1] <= spans[1][0] and spans[1][1] <= spans[2][0], spans  # one phase after the other
    assert not any(k.endswith("_at") for k in plain["eval_details"]["drawn"]), plain["eval_details"]


def test_trace_must_be_a_bool(shared_up):
    with shared_up.client() as c:
        ids = c.submit([dict(synthetic(3, trace="yes"), timeout_s=60)])
        r = next(iter(c.gather(ids, timeout_s=60)))
    assert r["status"] == "failed" and r["failed_phase"] == "init", (r["status"], r["error"])
    assert r["error"]["type"] == "SyntheticInstanceError" and "trace is 'yes'" in r["error"]["message"], r["error"]
