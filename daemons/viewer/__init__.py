"""``rolloutd view RESULTS.jsonl``: what the model saw, sampled and was trained on, in a browser.

One self-contained HTML file (styles, script and data inlined; nothing fetched, no server):
a batch overview (reward by domain and group, zero-variance groups marked, statuses and
failure phases, per-phase time) and one page per trajectory (turns as a chat, the tokens
underneath coloured by loss mask and logprob, policy version per turn, non-canonical splits,
segments of harness episodes, continuation turns, eval details). ``--serve`` serves the same
page on 127.0.0.1, re-read from the JSONL on every load (``rolloutd submit --out`` writes a
line per result as it arrives) with the gateway's queue counts in the header: a running batch
can be followed without taking its results away from the trainer (a gateway result is
delivered once; the viewer only reads the file). Decision written in docs/VIEWER.md.

Files: ``report.py`` (results -> rows, details, summary), ``page.py`` (the HTML writer),
``serve.py`` (``--serve``), ``assets/`` (page, script, styles).
"""
from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from . import page

__all__ = ["main", "tokenizer_named_in"]


def tokenizer_named_in(results: str) -> str | None:
    """The tokenizer the results name: a result's ``tokenizer`` or ``metrics.tokenizer``."""
    for _, r in _first(results, 50):
        for src in (r, r.get("metrics") if isinstance(r.get("metrics"), dict) else {}):
            t = src.get("tokenizer")
            if isinstance(t, str) and t:
                return t
    return None


def _first(results: str, n: int):
    from .report import read_results

    for k, item in enumerate(read_results(results)):
        if k >= n:
            return
        yield item


def load_tokenizer(name: str | None):
    """(tokenizer or None, a one-line note)."""
    if not name:
        return None, "no tokenizer given or named in the results: token ids are shown as numbers (--tokenizer DIR)"
    try:
        from rolloutd.llm.tokenizer_utils import load_tokenizer as load
    except ModuleNotFoundError as e:
        return None, f"cannot decode tokens: {e.name!r} is missing (pip install 'rolloutd[daemon]')"
    try:
        return load(name), f"tokenizer {name}"
    except Exception as e:  # noqa: BLE001 - a viewer still shows ids without one
        return None, f"cannot load tokenizer {name!r} ({type(e).__name__}: {e}); token ids are shown as numbers"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rolloutd view", description=__doc__.split("\n\n")[0])
    p.add_argument("results", help="trajectories JSONL (rolloutd submit --out, rolloutd demo --out)")
    p.add_argument("--out", help="HTML file to write (default: RESULTS with .html)")
    p.add_argument("--tokenizer", help="tokenizer directory to decode ids (default: the one the results name)")
    p.add_argument("--no-canonical", action="store_true",
                   help="skip the non-canonical split check (it re-encodes every sampled turn)")
    p.add_argument("--serve", action="store_true", help="serve the page on 127.0.0.1, re-read on every load")
    p.add_argument("--port", type=int, default=8765, help="port for --serve (0: any free port)")
    p.add_argument("--refresh", type=float, default=5.0, help="--serve: seconds between overview reloads")
    p.add_argument("--gateway", help="--serve: gateway address whose queue counts the header shows")
    p.add_argument("--runtime-dir", help="--serve: find the gateway at ipc://DIR/gateway.sock")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    if not args.serve and not Path(args.results).is_file():
        print(f"rolloutd view: no such file: {args.results}", file=sys.stderr)
        return 2
    name = args.tokenizer or (tokenizer_named_in(args.results) if Path(args.results).is_file() else None)
    tok, note = load_tokenizer(name)
    print(f"rolloutd view: {note}", file=sys.stderr)
    if args.serve:
        from .serve import serve_forever

        return serve_forever(args, tok, name or "")
    out = Path(args.out) if args.out else Path(args.results).with_suffix(".html")
    tmp = out.with_name(out.name + ".part")
    with open(tmp, "w", encoding="utf-8") as f:
        summary = page.write(args.results, f, tok, title=f"rolloutd: {Path(args.results).name}",
                             tokenizer_name=name if tok is not None else "", canonical=not args.no_canonical)
    tmp.replace(out)
    print(json.dumps({"out": str(out), "jobs": summary["jobs"], "by_status": summary["by_status"]}))
    return 0
