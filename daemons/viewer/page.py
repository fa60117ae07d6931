"""Writes the self-contained HTML page: styles, script and data inlined, nothing fetched.

The file is written as it is read: a detail record per trajectory (a ``<script
type="application/json">`` block the browser does not parse until that trajectory is opened),
then the overview rows, the summary and the vocabulary, then the script. JSON inside a script
block has ``</`` escaped, so no string in a result (a tool output printing ``</script>``) can
end the block.
"""
from __future__ import annotations

import json
from importlib import resources
from typing import IO, Any

from . import report


def _asset(name: str) -> str:
    return resources.files("rolloutd.daemons.viewer").joinpath("assets", name).read_text(encoding="utf-8")


def _json(obj: Any) -> str:
    return json.dumps(obj, separators=(",", ":"), ensure_ascii=False, allow_nan=False).replace("</", "<\\/")


def _block(out: IO[str], ident: str, obj: Any) -> None:
    out.write(f'<script type="application/json" id="{ident}">{_json(obj)}</script>\n')


def write(results_path: str, out: IO[str], tok: Any = None, *, title: str = "", tokenizer_name: str = "",
          canonical: bool = True, live: dict | None = None) -> dict:
    """Stream ``results_path`` into ``out`` as one HTML page; returns the summary."""
    head, tail = _asset("page.html").split("<!--DATA-->")
    out.write(head.replace("{{TITLE}}", title or "rolloutd trajectories")
              .replace("/*CSS*/", _asset("viewer.css")))
    canon = report.Canon(tok) if (tok is not None and canonical) else None
    rows: list[report.Row] = []
    ids: set[int] = set()
    for i, (_, r) in enumerate(report.read_results(results_path)):
        d = report.detail(r, canon)
        ids |= report.used_ids(d)
        _block(out, f"d-{i}", d)
        rows.append(report.row(i, r, d))
    summary = report.summarize(rows)
    _block(out, "rows", [r.to_json() for r in rows])
    _block(out, "summary", summary)
    _block(out, "vocab", report.vocab(tok, ids) if tok is not None else {})
    _block(out, "meta", {"source": str(results_path), "tokenizer": tokenizer_name, "live": live})
    out.write(tail.replace("/*JS*/", _asset("viewer.js")))
    return summary
