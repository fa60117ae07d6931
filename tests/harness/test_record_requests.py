"""Refused requests are recorded and logged with their path and API shape (issue 37 item 6):
Claude Code's non-essential traffic got a 401 ``invalid_api_key`` that ``record_requests`` did not
record and ``endpoint_call_refused`` logged without a path. A real endpoint on a real socket,
``record_requests`` around it as the harness handler wraps it."""
from __future__ import annotations

import asyncio
import json
from pathlib import Path

import httpx
import pytest
import structlog

pytest.importorskip("uvicorn", reason="uvicorn is not installed (pip install rolloutd[daemon])")

from rolloutd.handlers.harness_presets import record_requests
from rolloutd.endpoint.app import make_app
from rolloutd.endpoint.server import serve
from rolloutd.endpoint.session import EndpointSession


def test_refused_requests_are_recorded_and_logged_with_path_and_shape(tmp_path):
    async def generate(*a, **k):  # never reached: every request here is refused
        raise AssertionError("no request may reach the backend")

    async def main():
        session = EndpointSession(generate, None, api_key="the-key")
        server = await serve(record_requests(make_app(session), str(tmp_path), "job1", 2), host="127.0.0.1", port=0)
        try:
            async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{server.port}", timeout=30) as http:
                r1 = await http.post("/v1/messages", headers={"x-api-key": "wrong"},
                                     json={"model": "claude-haiku", "max_tokens": 5, "messages": []})
                r2 = await http.get("/v1/models", headers={"authorization": "Bearer wrong"})
                r3 = await http.post("/v1beta/models/m:countTokens?key=wrong", json={"contents": []})
        finally:
            await server.stop()
        return session, (r1, r2, r3)

    with structlog.testing.capture_logs() as logs:
        session, (r1, r2, r3) = asyncio.run(asyncio.wait_for(main(), 60))
    assert [r.status_code for r in (r1, r2, r3)] == [401, 401, 401]
    assert r1.json()["type"] == "error" and r1.json()["error"]["type"] == "authentication_error"  # its own shape
    rows = [json.loads(x) for x in Path(tmp_path, "job1.jsonl").read_text().splitlines()]
    assert [(x["method"], x["path"], x["shape"], x["status"]) for x in rows] == [
        ("POST", "/v1/messages", "anthropic", 401), ("GET", "/v1/models", "other", 401),
        ("POST", "/v1beta/models/m:countTokens", "gemini", 401)]
    assert json.loads(rows[0]["body"])["model"] == "claude-haiku" and rows[2]["query"] == "key=wrong"
    assert [x["attempt"] for x in rows] == [2, 2, 2]  # a re-dispatched job's runs share the file
    refused = [e for e in logs if e["event"] == "endpoint_call_refused"]
    assert [(e["path"], e["shape"], e["method"], e["code"]) for e in refused] == [
        ("/v1/messages", "anthropic", "POST", "invalid_api_key"), ("/v1/models", "other", "GET", "invalid_api_key"),
        ("/v1beta/models/m:countTokens", "gemini", "POST", "invalid_api_key")]
    assert session.metrics["refused_by_status"] == {"401 invalid_api_key": 3}
