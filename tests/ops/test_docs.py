"""The operator docs keep up with the code: every published topic is in docs/EVENTS.md, every
exported metric in docs/OPERATIONS.md."""
from __future__ import annotations

import re

from .helpers import ROOT

PACKAGES = ("bus", "daemons", "gateway", "handlers", "sandbox", "llm")


def published_topics() -> dict[str, str]:
    found = {}
    for pkg in PACKAGES:
        for path in (ROOT / pkg).rglob("*.py"):
            for m in re.finditer(r"\.publish\(\s*[\"']([a-z_]+\.[a-z_.]+)[\"']", path.read_text(errors="replace")):
                found.setdefault(m.group(1), str(path.relative_to(ROOT)))
    return found


def test_every_published_topic_is_documented():
    doc = (ROOT / "docs" / "EVENTS.md").read_text()
    topics = published_topics()
    assert {"daemon.heartbeat", "job.done", "control.cancel"} <= set(topics)
    missing = {t: where for t, where in topics.items() if f"### `{t}`" not in doc}
    assert not missing, f"topics published but not documented in docs/EVENTS.md: {missing}"


def test_every_exported_metric_is_documented():
    src = (ROOT / "daemons" / "exporter.py").read_text()
    names = set(re.findall(r"\"(rolloutd_[a-z_]+)\"", src))
    names |= {f"rolloutd_router_{k}" for k in re.findall(r"\(\"(leases|waiting|current_version)\"", src)}
    assert len(names) > 15
    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    short = {"rolloutd_backend_capacity": "_capacity", "rolloutd_backend_healthy": "_healthy",
             "rolloutd_backend_policy_version": "_policy_version", "rolloutd_router_waiting": "_waiting",
             "rolloutd_router_current_version": "_current_version", "rolloutd_gateway_paused": "rolloutd_gateway_paused"}
    missing = [n for n in sorted(names)
               if f"`{n}`" not in doc and f"`{n}_total`" not in doc and not (n in short and f"`{short[n]}" in doc)]
    assert not missing, f"metrics not documented in docs/OPERATIONS.md: {missing}"


def test_unit_names_in_operations_doc_exist():
    from rolloutd import systemd as units

    doc = (ROOT / "docs" / "OPERATIONS.md").read_text()
    shipped = {p.name.replace("@.", "@main.") for p in units.unit_files()}
    mentioned = set(re.findall(r"(rolloutd[a-z-]*@main\.(?:service|target))", doc))
    assert mentioned and mentioned <= shipped, mentioned - shipped
