"""``rolloutd demo``: the whole system on one machine with a mixed batch of math, code and swe tasks.

One command on a fresh machine:

1. builds the tiny model (``rolloutd.backends.tiny_model``) into the cache if it is absent; its tokenizer is
   the one the backend and the handlers share;
2. builds the swe task repositories if the cache lacks them (downloads pinned sdists once);
3. starts ``rolloutd up`` as a child process in a private runtime directory, with the sandbox
   runtime ``bwrap`` where it works (else ``local``, with a warning: no isolation);
4. starts an LLM backend: by default the oracle policy on a scripted vLLM-API backend (in this
   process; it solves tasks through the tools and gets every ``--wrong-every``-th one wrong on
   purpose), or with ``--backend hf`` the tiny random model behind ``rolloutd serve-hf`` (it
   cannot solve anything: rewards 0, but real sampling, real logprobs), or with ``--backend vllm``
   the tiny model's ``vllm`` variant on a real vLLM (CPU build, from the venv ``make vllm-venv``
   builds; ``--vllm-url`` uses one already running instead);
5. registers the backend, submits the batch, shows live progress, prints a summary per domain
   (jobs, mean reward, mean turns, phase times, failures by phase) and where the trajectories
   (JSONL, one result per line) were written;
6. stops everything it started, also on Ctrl-C (outstanding jobs are cancelled first).

``--domains math,code,swe,harness`` adds the harness section: mini-swe-agent (from PyPI, in a venv
built with pip on first use, mounted read-only into the sandboxes) on a few swe tasks through the
``harness`` handler and its per-job OpenAI endpoint; the oracle answers in mini-swe-agent's format.

Exit code: 0 when every job came back ``ok`` (whatever its reward), 1 when some job failed,
timed out or was cancelled, 2 when the system could not be started.
"""
from __future__ import annotations

import argparse
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections import Counter, defaultdict
from pathlib import Path

from rolloutd.daemons.children import die_with_parent

DOMAINS = ("math", "code", "swe")
# Opt-in (--domains ...,harness): mini-swe-agent from PyPI on swe tasks, through the harness handler.
HARNESS = "harness"
HARNESS_JOBS = 3  # at most: mini-swe-agent's start-up (LiteLLM) is ~5 s of CPU per job
MATH_DATASETS = ("basic_arithmetic", "chain_sum", "gsm_symbolic")


class DemoError(RuntimeError):
    pass


# -- set-up steps ----------------------------------------------------------------------------------
def tiny_model_dir(cache: Path, need_model: bool, console, variant: str = "default") -> Path:
    """The tiny model (or at least its tokenizer) in the cache, built if absent."""
    from rolloutd.backends.tiny_model import make_tiny_model

    d = cache / ("tiny-model" if variant == "default" else f"tiny-model-{variant}")
    full = (d / "rolloutd_tiny.json").exists()
    if full or ((d / "tokenizer_config.json").exists() and not need_model):
        return d
    try:
        import torch  # noqa: F401

        tokenizer_only = False
    except ImportError:
        if need_model:
            raise DemoError("--backend hf and vllm need torch to build the model (pip install 'rolloutd[torch]')") \
                from None
        tokenizer_only = True
    console.print(f"[dim]building the tiny model{' tokenizer' if tokenizer_only else ''} in {d} ...[/]")
    try:
        from transformers.utils import logging as hf_logging

        hf_logging.disable_progress_bar()
    except Exception:  # noqa: BLE001 - cosmetic
        pass
    d.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".tiny-model-", dir=d.parent))
    try:
        make_tiny_model(tmp, tokenizer_only=tokenizer_only, variant=variant)
        if d.exists():
            shutil.rmtree(d, ignore_errors=True)
        os.replace(tmp, d)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return d


def choose_runtime(want: str, console) -> str:
    from rolloutd.sandbox import bwrap_works

    if want != "auto":
        if want == "local":
            console.print("[bold yellow]warning:[/] the local sandbox runtime has NO isolation: agent commands run "
                          "on this host as you.")
        return want
    ok, detail = bwrap_works()
    if ok:
        return "bwrap"
    console.print(f"[bold yellow]warning:[/] bubblewrap does not work here ({detail}); using the local runtime, "
                  "which has NO isolation (agent commands run on this host as you).")
    return "local"


def build_tasks(per_domain: int, domains: list[str], hf: bool,
                presets: tuple[str, ...] = ("mini-swe-agent",)) -> list[dict]:
    tasks: list[dict] = []
    limits = {"max_turns": 3, "max_context": 4096, "sampling": {"max_tokens": 96}} if hf else {}
    swe_ids: list[str] = []
    if "swe" in domains or HARNESS in domains:
        from rolloutd.handlers.swe_tasks import task_ids

        swe_ids = sorted(task_ids())
    for i in range(per_domain):
        for d in domains:
            if d == "math":
                ds = MATH_DATASETS[i % len(MATH_DATASETS)]
                inst = {"dataset": ds, "seed": 2024, "index": i}
                iid = f"math/{ds}/{i}"
            elif d == "code":
                inst = {"task_id": f"HumanEval/{i % 164}"}
                iid = f"code/HumanEval/{i % 164}"
            elif d == HARNESS:
                if i >= HARNESS_JOBS:
                    continue
                tid = swe_ids[i % len(swe_ids)]
                for preset in presets:  # --harness-presets: mini-swe-agent, claude-code, codex, ...
                    tasks.append({"handler": d, "instance_id": f"harness/{preset}/{tid}", "instance": {
                        "preset": preset, "setup": {"domain": "swe", "instance": {"task_id": tid}},
                        "limits": {"max_llm_calls": 3 if hf else 8,
                                   "wall_s": 120 if preset == "mini-swe-agent" else 600}}})
                continue
            else:
                tid = swe_ids[i % len(swe_ids)]
                inst = {"task_id": tid}
                iid = f"swe/{tid}"
            tasks.append({"handler": d, "instance_id": iid, "instance": dict(inst, **limits)})
    return tasks


class Children:
    """Processes and backends this demo started; stopped in reverse order, exactly once."""

    def __init__(self):
        self.items: list[tuple[str, object]] = []
        self._done = False

    def add(self, name: str, obj):
        self.items.append((name, obj))
        return obj

    def stop(self, console=None):
        if self._done:
            return
        self._done = True
        for name, obj in reversed(self.items):
            try:
                if isinstance(obj, subprocess.Popen):
                    if obj.poll() is None:
                        obj.send_signal(signal.SIGTERM)
                        try:
                            obj.wait(40)
                        except subprocess.TimeoutExpired:
                            obj.kill()
                            obj.wait(5)
                else:
                    obj.stop()
            except Exception as e:  # noqa: BLE001 - keep stopping the rest
                if console is not None:
                    console.print(f"[red]could not stop {name}: {e}[/]")


def start_up(run_dir: Path, sets: list[str], log_path: Path, env: dict) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "rolloutd.daemons.cli", "up", "--runtime-dir", str(run_dir)]
    for s in sets:
        cmd += ["--set", s]
    return subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=open(log_path, "ab"), stderr=subprocess.STDOUT,
                            env=env, start_new_session=True, preexec_fn=die_with_parent)


def wait_up(proc: subprocess.Popen, gateway: str, log_path: Path, timeout_s: float = 60.0):
    from rolloutd.daemons.supervisor import wait_ready

    deadline = time.monotonic() + timeout_s
    while True:
        if proc.poll() is not None:
            raise DemoError(f"rolloutd up exited with code {proc.returncode}; log: {log_path}\n{_tail(log_path)}")
        try:
            return wait_ready(gateway, timeout_s=min(2.0, max(0.1, deadline - time.monotonic())))
        except TimeoutError:
            if time.monotonic() > deadline:
                raise DemoError(f"rolloutd up not ready after {timeout_s:.0f}s; log: {log_path}\n{_tail(log_path)}") \
                    from None


def start_hf(model_dir: Path, log_path: Path, env: dict, timeout_s: float = 120.0) -> tuple[subprocess.Popen, str]:
    cmd = [sys.executable, "-m", "rolloutd.daemons.cli", "serve-hf", str(model_dir), "--port", "0", "--max-batch-size", "16"]
    proc = subprocess.Popen(cmd, stdin=subprocess.DEVNULL, stdout=subprocess.PIPE, stderr=open(log_path, "ab"),
                            env=env, start_new_session=True, preexec_fn=die_with_parent, text=True)
    port: list[int] = []

    def reader():
        for line in proc.stdout:  # type: ignore[union-attr]
            if line.startswith("READY ") and not port:
                port.append(int(line.split()[1]))
        # keep draining so the server never blocks on a full pipe

    threading.Thread(target=reader, name="serve-hf-stdout", daemon=True).start()
    deadline = time.monotonic() + timeout_s
    while not port:
        if proc.poll() is not None:
            raise DemoError(f"rolloutd serve-hf exited with code {proc.returncode}; log: {log_path}\n{_tail(log_path)}")
        if time.monotonic() > deadline:
            proc.kill()
            raise DemoError(f"rolloutd serve-hf not ready after {timeout_s:.0f}s; log: {log_path}")
        time.sleep(0.05)
    return proc, f"http://127.0.0.1:{port[0]}"


def start_vllm(args, model_dir: Path, log_path: Path, children: Children, console) -> tuple[str, str]:
    """The demo's vLLM: the one at --vllm-url, or one started from the vLLM venv (stopped at the end)."""
    if args.vllm_url:
        return args.vllm_url.rstrip("/"), f"tiny random model on vLLM at {args.vllm_url}"
    from rolloutd.backends.vllm_cpu import VLLMServer, cpus_beside_daemons, default_venv, venv_ready

    venv = Path(args.vllm_venv or os.environ.get("ROLLOUTD_VLLM_VENV") or default_venv())
    if not venv_ready(venv):
        raise DemoError(f"no ready vLLM venv at {venv}: build it with `make vllm-venv` "
                        "(python -m rolloutd.backends.vllm_cpu venv DIR)")
    console.print(f"starting [bold]vLLM[/] ({venv}) on the tiny model ({model_dir}); log: {log_path} "
                  "(a minute or two on a small machine) ...")
    srv = children.add("vllm", VLLMServer(venv, model_dir, log_path=log_path, cpus=cpus_beside_daemons()))
    srv.start()
    try:
        srv.wait_ready()
    except (RuntimeError, TimeoutError) as e:
        raise DemoError(str(e)) from None
    return srv.url, f"tiny random model on vLLM {srv.version} at {srv.url}"


def _tail(path: Path, n: int = 3000) -> str:
    try:
        return path.read_text(errors="replace")[-n:]
    except OSError:
        return ""


# -- summary ---------------------------------------------------------------------------------------
def _mean(xs):
    xs = [x for x in xs if x is not None]
    return sum(xs) / len(xs) if xs else None


def summarize(results: list[dict]) -> dict[str, dict]:
    by: dict[str, list[dict]] = defaultdict(list)
    for r in results:
        by[r.get("handler") or "?"].append(r)
    out = {}
    for dom in sorted(by, key=lambda d: (DOMAINS.index(d) if d in DOMAINS else 9, d)):
        rs = by[dom]
        ok = [r for r in rs if r["status"] == "ok"]
        fails = Counter(f"{r['status']}@{r.get('failed_phase') or '?'}" for r in rs if r["status"] != "ok")
        out[dom] = {
            "jobs": len(rs), "ok": len(ok),
            "mean_reward": _mean([r["reward"] for r in ok]),
            "mean_turns": _mean([len(r.get("turns") or []) for r in ok]),
            "mean_tool_calls": _mean([(r.get("metrics") or {}).get("tool_calls") for r in ok]),
            **{f"{p}_s": _mean([(r.get("timing") or {}).get(p) for r in rs]) for p in ("queue", "init", "run", "eval")},
            "llm_s": _mean([(r.get("metrics") or {}).get("llm_s") for r in ok]),
            "tools_s": _mean([(r.get("metrics") or {}).get("tools_s") for r in ok]),
            "failures": dict(fails),
        }
    return out


def summary_table(summary: dict[str, dict]):
    from rich.table import Table

    t = Table(title="rolloutd demo: results by domain")
    for col, just in (("domain", "left"), ("jobs", "right"), ("ok", "right"), ("reward", "right"),
                      ("turns", "right"), ("tools", "right"), ("init/run/eval s", "right"), ("llm/tools s", "right"),
                      ("failures", "left")):
        t.add_column(col, justify=just)

    def f(x, nd=2):
        return "-" if x is None else f"{x:.{nd}f}"

    for dom, s in summary.items():
        fails = ", ".join(f"{k} x{v}" for k, v in sorted(s["failures"].items())) or "none"
        t.add_row(dom, str(s["jobs"]), str(s["ok"]), f(s["mean_reward"]), f(s["mean_turns"], 1),
                  f(s["mean_tool_calls"], 1), f"{f(s['init_s'])}/{f(s['run_s'])}/{f(s['eval_s'])}",
                  f"{f(s['llm_s'])}/{f(s['tools_s'])}", fails)
    t.caption = ("means over jobs; reward and turns over ok jobs; failures as status@phase; "
                 "tools = tool calls per job")
    return t


# -- main ------------------------------------------------------------------------------------------
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="rolloutd demo",
                                description="Run the whole system on this machine with a mixed batch of math, code "
                                            "and swe tasks, then print a summary.")
    p.add_argument("--per-domain", type=int, default=4, help="jobs per domain (default 4)")
    p.add_argument("--domains", default=",".join(DOMAINS),
                   help="comma-separated subset of math,code,swe,harness (harness: mini-swe-agent on swe tasks, "
                        "needs its venv: built with pip on first use)")
    p.add_argument("--harness-presets", default="mini-swe-agent",
                   help="comma-separated harness presets for the harness section (default mini-swe-agent; also "
                        "claude-code, codex, gemini-cli, qwen-code, opencode, pi, aider: docs/HARNESS.md)")
    p.add_argument("--agent-venv", default=None,
                   help="the harness's agent venv (default: $ROLLOUTD_AGENT_VENV or /var/tmp/rolloutd-agent-venv-UID)")
    p.add_argument("--backend", choices=["scripted", "hf", "vllm"], default="scripted",
                   help="scripted: the oracle policy (default); hf: the tiny random model via rolloutd serve-hf; "
                        "vllm: the tiny random model on a real vLLM (make vllm-venv)")
    p.add_argument("--vllm-venv", default=None,
                   help="--backend vllm: the vLLM venv (default: $ROLLOUTD_VLLM_VENV or /var/tmp/rolloutd-vllm-venv-UID)")
    p.add_argument("--vllm-url", default=None,
                   help="--backend vllm: a vLLM already serving the tiny model's vllm variant (its directory is "
                        "then --vllm-model); none is started")
    p.add_argument("--vllm-model", default=None, help="with --vllm-url: the served model's directory (its tokenizer)")
    p.add_argument("--wrong-every", type=int, default=3,
                   help="the oracle gets every N-th task wrong on purpose (0: never); scripted backend only")
    p.add_argument("--runtime", choices=["auto", "bwrap", "local"], default="auto", help="sandbox runtime")
    p.add_argument("--out", default=None, help="trajectories JSONL (default: <cache>/demo/trajectories-<time>.jsonl)")
    p.add_argument("--cache-dir", default=None,
                   help="cache for the tiny model, the swe repositories and the output (default: $ROLLOUTD_CACHE_DIR "
                        "or ~/.cache/rolloutd)")
    p.add_argument("--deadline", type=float, default=150.0, help="give up on results after this many seconds")
    p.add_argument("--no-progress", action="store_true", help="no live progress display")
    return p


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    from rich.console import Console

    console = Console()
    if not console.is_terminal:
        console = Console(width=max(console.width, 120))
    domains = [d.strip() for d in args.domains.split(",") if d.strip()]
    bad = [d for d in domains if d not in DOMAINS + (HARNESS,)]
    if bad or not domains or args.per_domain < 1:
        console.print(f"[red]rolloutd demo: --domains must be a subset of {','.join(DOMAINS + (HARNESS,))} and "
                      f"--per-domain >= 1[/]")
        return 2
    children = Children()
    got_signal: list[int] = []

    def on_term(signum, frame):
        got_signal.append(signum)
        raise KeyboardInterrupt

    old_term = signal.signal(signal.SIGTERM, on_term)
    old_int = signal.signal(signal.SIGINT, signal.default_int_handler)  # Ctrl-C, even if started ignored
    workdir = Path(tempfile.mkdtemp(prefix="rd-demo-", dir="/tmp"))  # short: ipc paths must fit 108 bytes
    os.chmod(workdir, 0o711)  # the sandbox root is inside; bwrap may run as another uid (nobody)
    try:
        return _run(args, console, domains, children, workdir)
    except DemoError as e:
        console.print(f"[red]rolloutd demo: {e}[/]")
        return 2
    except KeyboardInterrupt:
        console.print("[yellow]interrupted: stopping everything the demo started ...[/]")
        return 130
    finally:
        signal.signal(signal.SIGTERM, old_term)  # a second SIGTERM now ends us; children have PDEATHSIG
        signal.signal(signal.SIGINT, old_int)
        children.stop(console)
        shutil.rmtree(workdir, ignore_errors=True)


def _run(args, console, domains: list[str], children: Children, workdir: Path) -> int:
    from rolloutd.bus import logs
    from rolloutd.llm.tokenizer_utils import cache_dir as default_cache

    t_start = time.monotonic()
    cache = Path(args.cache_dir).expanduser() if args.cache_dir else default_cache()
    if args.cache_dir and not os.environ.get("ROLLOUTD_SWE_CACHE"):
        os.environ["ROLLOUTD_SWE_CACHE"] = str(cache / "swe_tasks")  # here and in the daemons
    out_path = Path(args.out) if args.out else cache / "demo" / f"trajectories-{time.strftime('%Y%m%d-%H%M%S')}.jsonl"
    out_path.parent.mkdir(parents=True, exist_ok=True)
    logs_dir = out_path.parent
    stem = out_path.stem
    demo_log = logs_dir / f"{stem}.demo.log"
    up_log = logs_dir / f"{stem}.up.log"
    # Libraries log through structlog: into a file, not over the live display.
    logs.configure("json", "warning", stream=open(demo_log, "a"))
    hf = args.backend in ("hf", "vllm")  # a random model: short limits (build_tasks)

    env = dict(os.environ, PYTHONUNBUFFERED="1")
    from rolloutd.handlers.tasks import entry_point_shim, missing_entry_points

    missing = missing_entry_points()
    if missing.get("rolloutd.handlers"):
        shim = entry_point_shim(workdir / "eps")
        env["PYTHONPATH"] = shim + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        console.print(f"[yellow]note:[/] the installed rolloutd metadata lacks the handlers "
                      f"{', '.join(missing['rolloutd.handlers'])}; registering them for this run "
                      "(reinstall with `pip install -e .` to make this permanent).")

    if args.backend == "vllm" and args.vllm_url:
        if not args.vllm_model:
            raise DemoError("--vllm-url needs --vllm-model (the served model's directory: its tokenizer)")
        model_dir = Path(args.vllm_model)
    else:
        model_dir = tiny_model_dir(cache, need_model=hf, console=console,
                                   variant="vllm" if args.backend == "vllm" else "default")
    runtime = choose_runtime(args.runtime, console)
    if "swe" in domains or HARNESS in domains:
        from rolloutd.handlers.swe_tasks import build_all, task_ids

        wanted = sorted(task_ids())[:min(args.per_domain, 12)]
        try:
            build_all(task_ids=wanted)
        except Exception as e:  # noqa: BLE001 - e.g. no network on a cold cache
            console.print(f"[yellow]warning:[/] swe tasks could not be built ({type(e).__name__}: {e}); "
                          "skipping the swe domain.")
            domains = [d for d in domains if d not in ("swe", HARNESS)]
            if not domains:
                raise DemoError("nothing left to run") from None

    # -- start the system ----------------------------------------------------------------------
    run_dir = workdir / "run"
    hcfg = {d: {"tokenizer": str(model_dir)} for d in DOMAINS}
    if HARNESS in domains:
        hcfg[HARNESS] = {"tokenizer": str(model_dir), "agent_venv": harness_venv(args, console)}
    # Sandboxes in the demo's own work dir: nothing of them outlives the demo.
    sets = [f"sandbox.runtime={runtime}", f"sandbox.root_dir={workdir / 'sb'}", "handlers=" + json.dumps(hcfg),
            "logging.format=json"]
    console.print(f"starting [bold]rolloutd up[/] (sandbox runtime: [bold]{runtime}[/]; log: {up_log}) ...")
    up = children.add("rolloutd up", start_up(run_dir, sets, up_log, env))
    gateway = f"ipc://{run_dir}/gateway.sock"

    if args.backend == "hf":
        console.print(f"starting [bold]rolloutd serve-hf[/] on the tiny model ({model_dir}) ...")
        hf_proc, url = start_hf(model_dir, logs_dir / f"{stem}.serve-hf.log", env)
        children.add("serve-hf", hf_proc)
        backend_desc = f"tiny random model via serve-hf at {url}"
    elif args.backend == "vllm":
        url, backend_desc = start_vllm(args, model_dir, logs_dir / f"{stem}.vllm.log", children, console)
    else:
        from rolloutd.handlers.harness_presets import HarnessOracle
        from rolloutd.backends.scripted import ScriptedBackend

        policy = HarnessOracle(wrong_every=args.wrong_every)  # the domain oracle, and mini-swe-agent's
        policy.warm()
        # The coding harnesses' system prompts and tool lists run to ~40K tokens of the tiny vocabulary.
        backend = children.add("scripted backend",
                               ScriptedBackend(str(model_dir), policy=policy, max_model_len=1 << 20))
        backend.start()
        url = backend.url
        backend_desc = f"oracle scripted backend (wrong_every={args.wrong_every}) at {url}"
    wait_up(up, gateway, up_log)
    t_ready = time.monotonic()

    from rolloutd.gateway.client import RolloutClient
    from rolloutd.gateway.records import to_jsonable

    tasks = build_tasks(args.per_domain, domains, hf, harness_presets(args.harness_presets))
    results: list[dict] = []
    with RolloutClient(gateway, timeout_s=10.0) as client:
        client.add_backend(url, policy_version=0)
        console.print(f"backend: {backend_desc}; submitting {len(tasks)} jobs "
                      f"({args.per_domain} per domain: {', '.join(domains)})")
        ids = client.submit(tasks)
        dom_of = {jid: t["handler"] for jid, t in zip(ids, tasks)}
        try:
            _collect(client, ids, dom_of, domains, results, out_path, args, console, to_jsonable)
        except KeyboardInterrupt:
            pending = [j for j in ids if j not in {r["job_id"] for r in results}]
            if pending:
                try:
                    client.cancel(pending)
                except Exception:  # noqa: BLE001
                    pass
            raise
    t_done = time.monotonic()

    summary = summarize(results)
    console.print(summary_table(summary))
    n_ok = sum(s["ok"] for s in summary.values())
    console.print(f"{len(results)} jobs in {t_done - t_ready:.1f}s after the system was up "
                  f"({t_done - t_start:.1f}s in all); {n_ok} ok.")
    console.print(f"trajectories (JSONL, one result per line): [bold]{out_path}[/]")
    console.print(f"see them in a browser: [bold]rolloutd view {out_path} --tokenizer {model_dir}[/]", soft_wrap=True)
    console.print(f"logs: {up_log}, {demo_log}")
    missing_n = len(ids) - len(results)
    if missing_n:
        console.print(f"[red]{missing_n} jobs did not finish before the deadline[/]")
    return 0 if n_ok == len(ids) else 1


def harness_presets(spec: str) -> tuple[str, ...]:
    from rolloutd.handlers.harness_presets import PRESETS

    names = tuple(p.strip() for p in spec.split(",") if p.strip())
    bad = [p for p in names if p not in PRESETS]
    if bad or not names:
        raise DemoError(f"--harness-presets: unknown {bad or spec!r}; presets: {', '.join(sorted(PRESETS))}")
    return names


def harness_venv(args, console) -> str:
    """The agent venv of the harness section: reused, or built with pip (mini-swe-agent, openai)."""
    from rolloutd.handlers.harness_presets import build_agent_venv, venv_ready

    path = args.agent_venv or os.environ.get("ROLLOUTD_AGENT_VENV") or f"/var/tmp/rolloutd-agent-venv-{os.getuid()}"
    if not venv_ready(path):
        console.print(f"building the agent venv for the harness section at {path} (pip: mini-swe-agent, openai) ...")
        try:
            build_agent_venv(path)
        except Exception as e:  # noqa: BLE001 - no index on a cold pip cache: say so
            raise DemoError(f"cannot build the agent venv at {path}: {e}; run without the harness domain") from None
    return path


def _collect(client, ids, dom_of, domains, results, out_path, args, console, to_jsonable):
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    from rolloutd.gateway.client import GatewayTimeout

    stats = {d: {"done": 0, "reward": 0.0, "failed": 0} for d in domains}
    with open(out_path, "w") as out, Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(),
                                              TimeElapsedColumn(), console=console,
                                              disable=args.no_progress) as prog:
        bars = {d: prog.add_task(f"{d:5s}", total=sum(1 for j in ids if dom_of[j] == d)) for d in domains}
        try:
            for r in client.gather(ids, timeout_s=args.deadline):
                results.append(r)
                out.write(json.dumps(to_jsonable(r)) + "\n")
                out.flush()
                d = r.get("handler") or dom_of.get(r["job_id"])
                s = stats.setdefault(d, {"done": 0, "reward": 0.0, "failed": 0})
                s["done"] += 1
                s["reward"] += float(r.get("reward") or 0.0)
                s["failed"] += r["status"] != "ok"
                if d in bars:
                    prog.update(bars[d], advance=1,
                                description=f"{d:5s} mean reward {s['reward'] / s['done']:.2f}  failed {s['failed']}")
                if args.no_progress:
                    console.print(f"  {r['instance_id']}: {r['status']} reward={r['reward']:.1f} "
                                  f"turns={len(r.get('turns') or [])}")
        except GatewayTimeout as e:
            console.print(f"[red]deadline: {e}[/]")


if __name__ == "__main__":  # pragma: no cover
    sys.exit(main())
