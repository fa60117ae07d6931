"""``python -m rolloutd.handlers.swe_tasks [--cache DIR] [--task ID ...] [--force] [--verify] [--list]``:
build the SWE task repositories and optionally verify them. The CLI lives here so that
``build`` (used by ``verify``) never imports ``verify`` back."""
from __future__ import annotations

import argparse
import sys

import structlog

from rolloutd.handlers.swe_tasks.build import ENV_CACHE, BuildError, DownloadError, build_all
from rolloutd.handlers.swe_tasks.taskdefs import load_tasks
from rolloutd.handlers.swe_tasks.verify import verify_all


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(prog="python -m rolloutd.handlers.swe_tasks",
                                 description="Build (and optionally verify) the swe task repositories.")
    ap.add_argument("--cache", default=None, help=f"cache dir (default: ${ENV_CACHE} or ~/.cache/rolloutd/swe_tasks)")
    ap.add_argument("--task", action="append", dest="tasks", metavar="ID", help="only this task (repeatable)")
    ap.add_argument("--force", action="store_true", help="rebuild even if the cache is current")
    ap.add_argument("--no-git", action="store_true", help="do not git-init the built repositories")
    ap.add_argument("--verify", action="store_true",
                    help="run each task's tests: buggy (F2P fail, P2P pass), oracle fix (resolved), "
                         "wrong fix (not resolved)")
    ap.add_argument("--python", default=sys.executable, help="interpreter for --verify (needs pytest)")
    ap.add_argument("--jobs", type=int, default=2, help="tasks verified in parallel")
    ap.add_argument("--list", action="store_true", help="list the tasks and exit")
    args = ap.parse_args(argv)

    if args.list:
        for t in load_tasks():
            print(f"{t['task_id']:40s} {t['library']}=={t['version']}  F2P={len(t['FAIL_TO_PASS'])} "
                  f"P2P={len(t['PASS_TO_PASS'])}")
        return 0
    try:
        repos = build_all(args.cache, task_ids=args.tasks, git=not args.no_git, force=args.force)
    except DownloadError as exc:
        print(f"error: could not fetch sdists: {exc}", file=sys.stderr)
        return 2
    except BuildError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 1
    for tid, path in repos.items():
        print(f"{tid:40s} {path}")
    if not args.verify:
        return 0
    reports = verify_all(args.cache, task_ids=args.tasks, python=args.python, jobs=args.jobs)
    bad = 0
    for r in reports:
        status = "ok" if r["ok"] else "FAIL"
        bad += not r["ok"]
        print(f"{status:4s} {r['task_id']:40s} buggy: F2P failing {r['buggy']['f2p_failing']}/{r['f2p_total']}, "
              f"P2P passing {r['buggy']['p2p_passing']}/{r['p2p_total']}; oracle resolved={r['oracle_resolved']}; "
              f"wrong resolved={r['wrong_resolved']}; {r['seconds']:.1f}s")
        for problem in r["problems"]:
            print(f"     - {problem}")
    print(f"{len(reports) - bad} of {len(reports)} tasks verified")
    return 1 if bad else 0


if __name__ == "__main__":
    structlog.configure(logger_factory=structlog.PrintLoggerFactory(sys.stderr))
    sys.exit(main())
