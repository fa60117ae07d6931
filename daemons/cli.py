"""The ``rolloutd`` command line: one subcommand per daemon plus operator tools."""
from __future__ import annotations

import argparse
import json
import os
import sys


def _daemon(name: str, args) -> int:
    from rolloutd.daemons.supervisor import config_from_args

    cfg = config_from_args(args.config, args.runtime_dir, args.set)
    cfg.check_layout()
    if name == "gateway":
        from rolloutd.gateway.daemon import Gateway as cls
    elif name == "router":
        from rolloutd.daemons.router import Router

        return Router(cfg, shard=args.shard).main()
    elif name == "events":
        from rolloutd.daemons.events import EventsDaemon as cls
    else:
        from rolloutd.daemons import phase

        cls = {"init": phase.InitDaemon, "run": phase.RunDaemon, "eval": phase.EvalDaemon}[name]
    return cls(cfg).main()


def cmd_up(args) -> int:
    from rolloutd.bus import logs
    from rolloutd.daemons.supervisor import Supervisor, config_from_args

    cfg = config_from_args(args.config, args.runtime_dir, args.set)
    cfg.check_layout()
    lc = cfg.section("logging")
    logs.configure(lc["format"], lc["level"])
    return Supervisor(cfg).run()


class NoGateway(Exception):
    """Nothing answers at the gateway address; the message says where and what to do."""


PROBE_S = 3.0  # how long a client command waits for a first answer before saying nobody is there


def _client(args):
    from rolloutd.daemons.supervisor import config_from_args
    from rolloutd.gateway.client import GatewayTimeout, RolloutClient
    from rolloutd.bus.messages import Status

    cfg = config_from_args(args.config, args.runtime_dir, [])
    address = args.gateway or cfg.endpoints.gateway
    hint = ("start one with `rolloutd up` (or `rolloutd gateway`), or point --gateway / --runtime-dir / "
            "--config at a running one")
    if address.startswith("ipc://") and not os.path.exists(address[len("ipc://"):]):
        raise NoGateway(f"no gateway answers at {address} (no such socket); {hint}")
    c = RolloutClient(address, timeout_s=args.timeout, curve=cfg.curve("client"))
    try:
        # One short probe instead of the command's own retries (4 x --timeout) against nobody.
        c.request(Status(), timeout_s=min(PROBE_S, args.timeout), retries=0)
    except GatewayTimeout:
        c.close()
        raise NoGateway(f"no gateway answers at {address} within {min(PROBE_S, args.timeout):g}s; {hint}") from None
    except BaseException:
        c.close()
        raise
    return c


def cmd_submit(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rolloutd.gateway.records import to_jsonable

    tasks = []
    with open(args.tasks) as f:
        for i, line in enumerate(f, 1):
            line = line.strip()
            if not line:
                continue
            try:
                t = json.loads(line)
            except ValueError as e:
                print(f"{args.tasks}:{i}: not JSON: {e}", file=sys.stderr)
                return 2
            if not isinstance(t, dict) or "handler" not in t or "instance" not in t:
                print(f"{args.tasks}:{i}: each line must be an object with a 'handler' and an 'instance' "
                      "(docs/PROTOCOL.md, the task map)", file=sys.stderr)
                return 2
            tasks.append(t)
    counts: dict[str, int] = {}
    # Line-buffered: each result is on disk as it arrives (`rolloutd view --serve` follows the file).
    with _client(args) as c, open(args.out, "w", buffering=1) as out:
        ids = c.submit(tasks, n=args.n)
        with Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                      transient=False, disable=args.quiet) as prog:
            bar = prog.add_task("rollouts", total=len(ids))
            for r in c.gather(ids, timeout_s=args.deadline):
                out.write(json.dumps(to_jsonable(r)) + "\n")
                counts[r["status"]] = counts.get(r["status"], 0) + 1
                prog.update(bar, advance=1, description=" ".join(f"{k}={v}" for k, v in sorted(counts.items())))
    print(json.dumps({"jobs": len(ids), "by_status": counts, "out": args.out}))
    if not args.quiet:
        print(f"see them in a browser: rolloutd view {args.out} --tokenizer <the model's tokenizer dir>", file=sys.stderr)
    return 0


def cmd_status(args) -> int:
    with _client(args) as c:
        print(json.dumps(c.status(), indent=2, default=str))
    return 0


def cmd_cancel(args) -> int:
    with _client(args) as c:
        print(json.dumps(c.cancel(args.job_ids), indent=2))
    return 0


def cmd_backend(args) -> int:
    with _client(args) as c:
        if args.action == "add":
            out = c.add_backend(args.address, api=args.api, policy_version=args.policy_version,
                                capacity=args.capacity, weight=args.weight, node=args.node, shard=args.shard)
        elif args.action == "clear":
            out = c.clear_backends(args.address)
        else:
            out = c.list_backends()
    print(json.dumps(out, indent=2))
    return 0


# Commands owned by other packages: ``rolloutd NAME ARGS...`` calls ``module.main(ARGS)``.
TOOLS = {
    "doctor": ("rolloutd.sandbox.doctor", "preflight: which sandbox runtimes really work on this node"),
    "serve-hf": ("rolloutd.backends.serve_hf", "serve a local transformers model behind vLLM's /v1/completions (CPU reference backend)"),
    "make-tiny-model": ("rolloutd.backends.tiny_model", "build a tiny random Qwen2-architecture model with a local BPE and ChatML template"),
    "scripted-backend": ("rolloutd.backends.scripted", "a scripted stand-in for vLLM/SGLang, for tests and benchmarks"),
    "monitor": ("rolloutd.daemons.monitor", "live terminal view of the events stream"),
    "exporter": ("rolloutd.daemons.exporter", "Prometheus exporter fed by the events stream"),
    "keys": ("rolloutd.daemons.keys", "CURVE keys for tcp deployments"),
    "demo": ("rolloutd.daemons.demo", "the whole system on the embedded default, with a mixed batch of tasks"),
    "view": ("rolloutd.daemons.viewer", "a trajectory viewer: results JSONL -> one self-contained HTML page (or --serve)"),
}


def _tool(name: str, argv: list[str]) -> int:
    import importlib

    module, _ = TOOLS[name]
    try:
        mod = importlib.import_module(module)
    except ModuleNotFoundError as e:
        print(f"rolloutd {name}: not available in this installation ({e})", file=sys.stderr)
        return 2
    return mod.main(argv) or 0


def version_line() -> str:
    from rolloutd import __version__
    from rolloutd.bus.messages import PROTOCOL_VERSION

    return f"rolloutd {__version__} (wire protocol {PROTOCOL_VERSION})"


def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rolloutd", description="rollout-as-a-service for multi-turn agent RL")
    p.add_argument("--version", action="version", version=version_line())
    sub = p.add_subparsers(dest="cmd", required=True)

    def common(sp):
        sp.add_argument("--config", help="TOML config file (default: $ROLLOUTD_CONFIG or built-in defaults)")
        sp.add_argument("--runtime-dir", help="directory for ipc sockets (default: $ROLLOUTD_RUNTIME_DIR)")
        sp.add_argument("--set", action="append", default=[], metavar="SECTION.KEY=VALUE",
                        help="override one config value (JSON or a bare string)")

    def client_opts(sp):
        common(sp)
        sp.add_argument("--gateway", help="gateway address (default: from the config)")
        sp.add_argument("--timeout", type=float, default=10.0, help="per-request timeout in seconds")

    for name, (_, help_text) in TOOLS.items():
        sp = sub.add_parser(name, help=help_text, add_help=False)
        sp.add_argument("argv", nargs=argparse.REMAINDER)
        sp.set_defaults(fn=lambda a, n=name: _tool(n, a.argv))

    sp = sub.add_parser("up", help="run every daemon of this machine, supervised")
    common(sp)
    sp.set_defaults(fn=cmd_up)
    for name in ("gateway", "router", "init", "run", "eval", "events"):
        sp = sub.add_parser(name, help=f"run the {name} daemon")
        common(sp)
        if name == "router":
            sp.add_argument("--shard", type=int, default=0,
                            help="which router shard this process is, 0..router.shards-1 (docs/SCALING.md)")
        sp.set_defaults(fn=lambda a, n=name: _daemon(n, a))

    sp = sub.add_parser("submit", help="submit tasks from a JSONL file and write results as JSONL")
    client_opts(sp)
    sp.add_argument("tasks")
    sp.add_argument("--out", required=True)
    sp.add_argument("-n", type=int, default=None, help="samples per task (overrides each line's n)")
    sp.add_argument("--deadline", type=float, default=None, help="give up after this many seconds")
    sp.add_argument("--quiet", action="store_true")
    sp.set_defaults(fn=cmd_submit)

    sp = sub.add_parser("status", help="queue depths, daemons and backends")
    client_opts(sp)
    sp.set_defaults(fn=cmd_status)

    sp = sub.add_parser("cancel", help="cancel jobs")
    client_opts(sp)
    sp.add_argument("job_ids", nargs="+", type=int)
    sp.set_defaults(fn=cmd_cancel)

    sp = sub.add_parser("backend", help="manage LLM backends")
    client_opts(sp)
    sp.add_argument("action", choices=["add", "clear", "list"])
    sp.add_argument("address", nargs="?")
    sp.add_argument("--api", default="vllm", choices=["vllm", "sglang"])
    sp.add_argument("--policy-version", type=int, default=0)
    sp.add_argument("--capacity", type=int, default=0)
    sp.add_argument("--weight", type=float, default=1.0)
    sp.add_argument("--node", default="")
    sp.add_argument("--shard", type=int, default=-1,
                    help="router shard to hold it (router.shards > 1; default -1: by a hash of the address)")
    sp.set_defaults(fn=cmd_backend)
    return p


def main(argv: list[str] | None = None) -> int:
    from rolloutd.bus.config import ConfigError
    from rolloutd.gateway.client import GatewayError, GatewayTimeout

    argv = sys.argv[1:] if argv is None else argv
    if argv and argv[0] in TOOLS:  # pass everything, --help included, to the tool itself
        return _tool(argv[0], argv[1:])
    args = build_parser().parse_args(argv)
    if getattr(args, "cmd", None) == "backend" and args.action == "add" and not args.address:
        print("rolloutd backend add: an address is required", file=sys.stderr)
        return 2
    try:
        return args.fn(args) or 0
    except ConfigError as e:
        print(f"rolloutd: {e}", file=sys.stderr)
        return 2
    except ModuleNotFoundError as e:  # a client-only install (no daemon extra)
        if (e.name or "").split(".")[0] == "rolloutd":
            raise
        print(f"rolloutd {args.cmd}: needs {e.name!r}, part of the daemon extra: pip install 'rolloutd[daemon]'",
              file=sys.stderr)
        return 2
    except NoGateway as e:
        print(f"rolloutd {args.cmd}: {e}", file=sys.stderr)
        return 3
    except GatewayTimeout as e:  # the gateway answered the probe, then went away
        print(f"rolloutd {args.cmd}: the gateway stopped answering: {e}", file=sys.stderr)
        return 3
    except GatewayError as e:
        print(f"rolloutd {args.cmd}: the gateway refused the request: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
