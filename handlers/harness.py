"""``harness``: an unmodified agent program in a sandbox, trained through a token-capturing endpoint.

Over ~700 lines because it is one domain's three phases and its instance schema, whose every key
is checked here; presets, episodes and graders live in their own modules.

Instance (every key is checked; unknown keys are an error)::

    {
      "preset": "mini-swe-agent",                 # or "openai-tools"; or give "command" yourself
      "command": ["my-agent", "--task", "{task}"], # argv; {task} and {task_file} are substituted
      "env": {"MY_AGENT_MODE": "train"},           # merged over the preset's
      "task_via": "arg" | "file" | "stdin",        # how the task text reaches the agent
      "task": "Fix the failing test.",             # the task text (or from the setup's domain)
      "setup": {"domain": "swe", "instance": {"task_id": "..."},   # an existing task domain, or
                "files": {"README.md": "..."}, "repository": "<name>", "image": "/path/rootfs"},
      "limits": {"max_llm_calls": 30, "max_context": 16384, "max_tokens": 1024, "wall_s": 600},
      "eval": {"pytest": ["tests"], "timeout_s": 120, "files": {...}, "restore": ["tests"]}
              # or {"command": [...], "reward": "exit_code" | "stdout"} (no pytest hardening: warned)
              # or {"scorer": "swe" | "math" | "code"} (default: the setup's domain)
      "tokenizer": "...", "parser": "hermes", "cwd": "/workspace", "task_tag": true
    }

init makes the sandbox (a domain's task setup and sandbox, or ``files``/``repository``/``image``)
and mounts the agent virtual environment (``[handlers.harness] agent_venv`` or
``$ROLLOUTD_AGENT_VENV``) read-only at the same path. run starts the job's OpenAI-compatible
endpoint (rolloutd.endpoint) on a Unix socket in the sandbox's run directory, which
the run daemon's LLM lease serves; the tool server's ``relay`` makes it ``127.0.0.1:<port>``
inside the sandbox, and its ``agent`` tool runs the command with ``OPENAI_BASE_URL`` /
``OPENAI_API_KEY`` set, to its end or its wall budget. eval writes ``eval.files`` and restores
``eval.restore`` after the purge, then runs pytest with the shared hardening (reward 1 when every
test passed), the command (reward 1 when it exits 0, or the finite number on its last stdout line)
or the domain's scorer (docs/HARNESS.md, "Grading").

Host paths never come from a request: the venv and the named repositories come from the
handler's config (``agent_venv``, ``repositories = {name = "/path"}``).

Failures: an agent that exits non-zero or crashes after at least one answered LLM call, with no
5xx answer and no fatal session error, is graded as it left the workspace (status ``ok``,
``eval_details["reason"]`` says so: docs/RELIABILITY.md, "No abstention"); otherwise the job is
``failed`` in run with ``error.type == "AgentExited"``. Either way its exit code and the tail of
its output are in ``eval_details["agent"]`` and the tokens sampled in the trajectory; past its wall
budget it is killed (whole process tree) and the job is ``timeout``. Cancel and the job's own
deadline kill the agent the same way and make the endpoint refuse further calls.
"""
from __future__ import annotations

import asyncio
import importlib
import os
import re
import secrets
import shutil
import time
from pathlib import Path
from typing import Any

import structlog

from rolloutd.handlers.base import AgentHandler, JobContext, PhaseTimeout
from rolloutd.handlers.pytest_grader import AGENT_ERRNOS
from rolloutd.handlers.harness_presets import AGENT_DIR, PRESETS, agent_script_binds, node_bin, record_requests

TOP_KEYS = {"preset", "command", "env", "task_via", "task", "setup", "limits", "eval", "tokenizer", "parser",
            "task_tag", "cwd", "home_files"}
SETUP_KEYS = {"domain", "instance", "files", "repository", "image"}
LIMIT_KEYS = {"max_llm_calls": int, "max_context": int, "max_tokens": int, "wall_s": float, "memory_mb": int,
              "address_space_mb": int}
EVAL_KEYS = {"command", "pytest", "scorer", "timeout_s", "reward", "files", "restore", "pytest_config"}
DOMAINS = ("swe", "math", "code")
TASK_VIA = ("arg", "file", "stdin")
TASK_FILE = ".rolloutd_task.md"
LLM_SOCKET = "llm.sock"
TAIL_CHARS = 16384  # output_tail and eval_output: the last 16 KiB, as the agent tool's tail_bytes

log = structlog.get_logger("rolloutd.harness")


class HarnessInstanceError(ValueError):
    """The instance is malformed; the message says which key and why."""


class AgentExited(RuntimeError):
    """The agent program exited non-zero (or was killed by a signal)."""


def _fail(msg: str):
    raise HarnessInstanceError(msg)


def _strs(v: Any, what: str, empty_ok: bool = False) -> list[str]:
    if not isinstance(v, list) or (not v and not empty_ok) or not all(isinstance(a, str) for a in v):
        _fail(f"{what} must be a {'' if empty_ok else 'non-empty '}list of strings, got {v!r:.200}")
    return list(v)


def _env(v: Any, what: str) -> dict[str, str]:
    import re

    if not isinstance(v, dict):
        _fail(f"{what} must be an object of strings")
    for k, x in v.items():
        if not isinstance(k, str) or not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", k) or not isinstance(x, str):
            _fail(f"{what}: {k!r} must be a variable name mapped to a string")
    return dict(v)


def _number(v: Any, cast, what: str):
    import math

    if (isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v) or v <= 0
            or (cast is int and int(v) != v)):
        _fail(f"{what} must be a positive {'integer' if cast is int else 'number'}, got {v!r}")
    return cast(v)


def validate(instance: Any, config: dict) -> dict:
    """The instance, checked and normalised (preset applied). Raises HarnessInstanceError."""
    if not isinstance(instance, dict):
        _fail("a harness instance is an object")
    unknown = set(instance) - TOP_KEYS
    if unknown:
        _fail(f"unknown instance keys {sorted(unknown)}; allowed: {sorted(TOP_KEYS)}")
    out: dict[str, Any] = {}
    preset = instance.get("preset")
    base: dict[str, Any] = {}
    if preset is not None:
        if preset not in PRESETS:
            _fail(f"unknown preset {preset!r}; presets: {sorted(PRESETS)}")
        base = PRESETS[preset]
    out["preset"] = preset
    command = instance.get("command", base.get("command"))
    if command is None:
        _fail("name the agent: 'command' (an argv) or a 'preset'")
    out["command"] = _strs(command, "'command'")
    out["env"] = dict(base.get("env") or {})
    out["env"].update(_env(instance.get("env", {}), "'env'"))
    home_files = instance.get("home_files", {})
    if not isinstance(home_files, dict) or not all(
            isinstance(k, str) and k and not k.startswith("/") and ".." not in k.split("/") and isinstance(v, str)
            for k, v in home_files.items()):
        _fail("'home_files' maps paths relative to $HOME (no '..') to file contents (strings)")
    out["home_files"] = dict(base.get("home_files") or {}, **home_files)
    if out["home_files"] and not out["env"].get("HOME", "").startswith("/"):
        _fail("'home_files' need an absolute HOME in 'env' (a writable directory inside the sandbox)")
    out["task_via"] = instance.get("task_via", base.get("task_via", "arg"))
    if out["task_via"] not in TASK_VIA:
        _fail(f"'task_via' must be one of {TASK_VIA}, got {out['task_via']!r}")
    if out["task_via"] == "arg" and not any("{task}" in a for a in out["command"]):
        _fail("task_via 'arg' needs a '{task}' placeholder in 'command'")
    cwd = instance.get("cwd")
    if cwd is not None and (not isinstance(cwd, str) or not cwd.startswith("/")):
        _fail("'cwd' must be an absolute path inside the sandbox")
    out["cwd"] = cwd

    setup = instance.get("setup", {})
    if not isinstance(setup, dict):
        _fail("'setup' must be an object")
    unknown = set(setup) - SETUP_KEYS
    if unknown:
        _fail(f"unknown setup keys {sorted(unknown)}; allowed: {sorted(SETUP_KEYS)}")
    domain = setup.get("domain")
    if domain is not None and domain not in DOMAINS:
        _fail(f"setup.domain must be one of {DOMAINS}, got {domain!r}")
    dinst = setup.get("instance", {})
    if not isinstance(dinst, dict) or (dinst and domain is None):
        _fail("setup.instance is the domain's own instance (an object) and needs setup.domain")
    files = setup.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(k, str) and isinstance(v, str) for k, v in files.items()):
        _fail("setup.files maps workspace-relative paths to file contents (strings)")
    _file_keys(files, "setup.files")  # eval copies them back on the host: never a path out of the workspace
    repo = setup.get("repository")
    repos = config.get("repositories") or {}
    if repo is not None:
        if not isinstance(repo, str) or repo not in repos:
            _fail(f"setup.repository {repo!r} is not one of the repositories named in [handlers.harness] "
                  f"repositories: {sorted(repos)}")
        if domain is not None:
            _fail("setup.repository and setup.domain exclude each other (the domain brings its own files)")
    image = setup.get("image")
    if image is not None and (not isinstance(image, str) or not image.startswith("/")):
        _fail("setup.image must be an absolute path of an image on the node")
    out["setup"] = {"domain": domain, "instance": dict(dinst), "files": dict(files), "repository": repo,
                    "image": image}

    task = instance.get("task")
    if task is not None and (not isinstance(task, str) or not task.strip()):
        _fail("'task' must be a non-empty string")
    if task is None and domain is None:
        _fail("give the task text ('task') or a setup.domain that provides it")
    out["task"] = task

    limits = instance.get("limits", {})
    if not isinstance(limits, dict):
        _fail("'limits' must be an object")
    unknown = set(limits) - set(LIMIT_KEYS)
    if unknown:
        _fail(f"unknown limits {sorted(unknown)}; allowed: {sorted(LIMIT_KEYS)}")
    lim = dict(base.get("limits") or {})
    lim.update({k: _number(v, LIMIT_KEYS[k], f"limits.{k}") for k, v in limits.items()})
    lim.setdefault("wall_s", float(config.get("wall_s", 900.0)))
    lim.setdefault("max_context", int(config.get("max_context", 16384)))
    lim.setdefault("max_tokens", int(config.get("max_tokens", 1024)))
    for k in ("memory_mb", "address_space_mb"):  # the handler's config wins over a preset's default
        if k not in limits and config.get(k) is not None:
            lim[k] = _number(config[k], int, f"[handlers.harness] {k}")
    out["limits"] = lim

    ev = instance.get("eval")
    if ev is None:
        if domain is None:
            _fail("'eval' is required without setup.domain: {\"pytest\": [...]}, {\"command\": [...]} or {\"scorer\": ...}")
        ev = {"scorer": domain}
    if not isinstance(ev, dict):
        _fail("'eval' must be an object")
    unknown = set(ev) - EVAL_KEYS
    if unknown:
        _fail(f"unknown eval keys {sorted(unknown)}; allowed: {sorted(EVAL_KEYS)}")
    modes = [k for k in ("command", "pytest", "scorer") if k in ev]
    if len(modes) != 1:
        _fail("'eval' takes exactly one of 'command', 'pytest' and 'scorer'")
    if "scorer" in ev:
        if ev["scorer"] not in DOMAINS:
            _fail(f"eval.scorer must be one of {DOMAINS}, got {ev['scorer']!r}")
        if ev["scorer"] != domain:
            _fail(f"eval.scorer {ev['scorer']!r} needs setup.domain {ev['scorer']!r} (its task and answer)")
        if set(ev) - {"scorer"}:
            _fail("eval.timeout_s, eval.reward, eval.files, eval.restore and eval.pytest_config go with "
                  "eval.command or eval.pytest")
        out["eval"] = {"scorer": ev["scorer"]}
    else:
        out["eval"] = _grading(ev, out["setup"])
    for k in ("tokenizer", "parser"):
        if k in instance and not isinstance(instance[k], str):
            _fail(f"'{k}' must be a string")
        out[k] = instance.get(k)
    if out["tokenizer"] is not None:  # a name the config maps to a directory: host paths never come from a request
        allowed = config.get("tokenizers") or {}
        if out["tokenizer"] not in allowed:
            _fail(f"'tokenizer' must name one of [handlers.harness] tokenizers ({sorted(allowed) or 'none configured'}), "
                  f"not {out['tokenizer']!r}: a request never gives a host path")
        out["tokenizer"] = str(allowed[out["tokenizer"]])
    out["task_tag"] = instance.get("task_tag", True)
    return out


def _rel(v: Any, what: str) -> str:
    from rolloutd.handlers.pytest_grader import check_rel

    try:
        return check_rel(v)
    except ValueError:
        _fail(f"{what}: {v!r:.200} is not a relative path inside the workspace (no '..')")


def _grading(ev: dict, setup: dict) -> dict:
    """``eval.command`` / ``eval.pytest`` with the files written and restored after the purge."""
    out: dict[str, Any] = {"timeout_s": _number(ev.get("timeout_s", 300.0), float, "eval.timeout_s")}
    files = ev.get("files", {})
    if not isinstance(files, dict) or not all(isinstance(v, str) for v in files.values()):
        _fail("eval.files maps workspace-relative paths to file contents (strings)")
    out["files"] = dict(zip(_file_keys(files, "eval.files"), files.values()))
    restore = ev.get("restore")
    if restore is not None:
        restore = [_rel(r, "eval.restore") for r in _strs(restore, "eval.restore", empty_ok=True)]
        if restore and setup["domain"] is not None:
            _fail("eval.restore copies paths back from setup.files or setup.repository, not from a setup.domain")
        for r in restore:
            if setup["repository"] is None and not _in_files(r, setup["files"]):
                _fail(f"eval.restore: {r!r} is not in setup.files (nor is there a setup.repository)")
    if "command" in ev:
        reward = ev.get("reward", "exit_code")
        if reward not in ("exit_code", "stdout"):
            _fail("eval.reward must be 'exit_code' (1 if the command exits 0) or 'stdout' (its last line, a number)")
        if "pytest_config" in ev:
            _fail("eval.pytest_config goes with eval.pytest")
        out.update(command=_strs(ev["command"], "eval.command"), reward=reward, restore=restore or [])
        return out
    if "reward" in ev:
        _fail("eval.reward goes with eval.command (eval.pytest: reward 1 when every test passes)")
    out["pytest"] = _strs(ev["pytest"], "eval.pytest")
    if restore is None:  # the default: the test paths pytest is given, as the setup wrote them
        restore = [] if setup["domain"] is not None else default_restore(out["pytest"], setup, out["files"])
    out["restore"] = restore
    cfg = ev.get("pytest_config")
    if cfg is not None:
        cfg = _rel(cfg, "eval.pytest_config")
        if cfg not in out["files"] and not any(cfg == r or cfg.startswith(r + "/") for r in restore):
            _fail(f"eval.pytest_config {cfg!r} must be one of eval.files or under eval.restore "
                  "(written by the host after the purge)")
    out["pytest_config"] = cfg
    return out


def _file_keys(files: dict, what: str) -> list[str]:
    """The keys of a files map, normalised: each a workspace path (no NUL, no name over 255 bytes),
    none also the directory of another (written at eval, such a map would fail there, and that
    failure would read as the agent's)."""
    keys = [_rel(k, what) for k in files]
    seen = set(keys)
    for k in keys:
        parts = k.split("/")
        clash = next((d for d in ("/".join(parts[:i]) for i in range(1, len(parts))) if d in seen), None)
        if clash is not None or keys.count(k) > 1:
            _fail(f"{what}: {clash or k!r} is both a file and a directory (or given twice) in the map")
    return keys


def _in_files(rel: str, files: dict) -> bool:
    return any(k == rel or k.startswith(rel + "/") for k in (f.strip("/") for f in files))


# pytest options whose value is the next argument (not a path to restore)
VALUE_OPTIONS = {"-k", "-m", "-p", "-o", "-c", "-W", "-r", "--tb", "--maxfail", "--durations", "--deselect", "--ignore",
                 "--ignore-glob", "--rootdir", "--confcutdir", "--basetemp", "--junitxml", "--log-level", "--import-mode",
                 "--capture", "--color", "--override-ini", "--pythonwarnings", "--config-file"}


def default_restore(args: list[str], setup: dict, written: dict) -> list[str]:
    """``eval.pytest``'s default ``eval.restore``: the tree of each path argument (before ``::``),
    whole: a directory, or for a file the directory holding it (its ``__init__.py``, conftest.py and
    helpers are imported with it), or the file alone at the workspace root. Restored from the setup,
    or removed where the setup has none (then ``eval.files`` are written into it)."""
    from rolloutd.handlers.pytest_grader import check_rel

    out: list[str] = []
    for i, a in enumerate(args):
        if a.startswith("-") or (i and args[i - 1] in VALUE_OPTIONS):
            continue
        try:
            rel = check_rel(a.split("::", 1)[0])
        except ValueError:
            continue
        is_file = rel in setup["files"] or rel in written or rel.endswith(".py")
        tree = os.path.dirname(rel) if is_file and os.path.dirname(rel) else rel
        if tree not in out and not any(tree.startswith(t + "/") for t in out):
            out = [t for t in out if not t.startswith(tree + "/")] + [tree]
    return out


class _DomainView(JobContext):
    """The job's context as a domain handler sees it: the same job, state and sandbox, but the
    domain's own instance."""

    def __init__(self, ctx: JobContext, instance: dict):
        self.__dict__.update(ctx.__dict__)
        self._domain_instance = instance

    @property
    def instance(self) -> dict:
        return self._domain_instance


class HarnessHandler(AgentHandler):
    needs_sandbox = True
    needs_llm = True
    eval_needs_sandbox = True

    def __init__(self, config: dict | None = None):
        super().__init__(config)
        self._domains: dict[str, Any] = {}

    # -- helpers -------------------------------------------------------------------------------
    def domain(self, name: str):
        h = self._domains.get(name)
        if h is None:
            from rolloutd.handlers.registry import UnknownHandler, _entry_points

            ep = _entry_points().get(name)
            if ep is None:
                raise UnknownHandler(f"the {name} domain is not installed (no {name!r} handler entry point)")
            # Its own instance, configured by [handlers.harness.<domain>] (tokenizer: the harness's).
            cfg = dict(self.config.get(name) or {})
            cfg.setdefault("tokenizer", self.config.get("tokenizer"))
            h = self._domains[name] = ep.load()(cfg)
        return h

    def spec(self, ctx: JobContext) -> dict:
        h = ctx.state.get("harness")
        if h is None:
            h = ctx.state["harness"] = validate(ctx.instance, self.config)
        return h

    def view(self, ctx: JobContext) -> _DomainView:
        h = self.spec(ctx)
        inst = dict(h["setup"]["instance"])
        inst.setdefault("task_tag", h["task_tag"])
        return _DomainView(ctx, inst)

    def agent_venv(self) -> str | None:
        v = self.config.get("agent_venv") or os.environ.get("ROLLOUTD_AGENT_VENV")
        if not v:
            return None
        if not os.path.isabs(v) or not os.path.isfile(os.path.join(v, "bin", "python")):
            raise ValueError(f"agent_venv {v!r} is not a virtual environment (no bin/python)")
        return v

    def agent_mounts(self) -> list[str]:
        """Host directories mounted read-only at the same path: the agent venv (with the Node
        harnesses' cache in ``<venv>/node``) and ``[handlers.harness] mounts`` (any other agent's
        install: a node_modules tree, a binary's directory). Config only, never a request."""
        out = [v for v in (self.agent_venv(),) if v]
        extra = self.config.get("mounts") or []
        if isinstance(extra, str) or not all(isinstance(p, str) and os.path.isabs(p) for p in extra):
            raise ValueError(f"[handlers.harness] mounts must be a list of absolute paths, got {extra!r}")
        for p in extra:
            if not os.path.isdir(p):
                raise ValueError(f"[handlers.harness] mounts: {p} is not a directory")
        return out + [p for p in extra if p not in out]

    def agent_path(self) -> str:
        """PATH inside the sandbox: the venv's bin, the Node cache's .bin, each mount's bin."""
        from rolloutd.handlers.tasks import SANDBOX_PATH

        dirs = []
        for m in self.agent_mounts():
            dirs += [d for d in (f"{m}/bin", node_bin(m), f"{m}/node_modules/.bin") if os.path.isdir(d)]
        return ":".join(dirs + [SANDBOX_PATH])

    def tokenizer_path(self, ctx: JobContext) -> str:
        path = self.spec(ctx)["tokenizer"] or self.config.get("tokenizer") or os.environ.get("ROLLOUTD_TOKENIZER")
        if not path:
            raise ValueError("no tokenizer: set [handlers.harness] tokenizer, $ROLLOUTD_TOKENIZER or instance.tokenizer")
        return str(path)

    async def tokenizer_async(self, ctx: JobContext):
        """The job's tokenizer, loaded off the event loop once per daemon (shared with every handler)."""
        from rolloutd.llm.tokenizer_utils import shared_tokenizer_async

        return await shared_tokenizer_async(self.tokenizer_path(ctx))

    # -- init ----------------------------------------------------------------------------------
    async def init(self, ctx: JobContext):
        h = self.spec(ctx)
        await asyncio.to_thread(self._init_sync, ctx, h)

    def _init_sync(self, ctx: JobContext, h: dict) -> None:
        from rolloutd.sandbox import Limits, SandboxSpec

        setup = h["setup"]
        domain = self.domain(setup["domain"]) if setup["domain"] else None
        if domain is not None:
            v = self.view(ctx)
            domain.setup_task(v)
            spec = domain.sandbox_spec(v)
            task_text = h["task"] or domain.user_message(v)
        else:
            spec = SandboxSpec(limits=Limits(memory_mb=4096, nproc=512, cpu_seconds=3600, file_size_mb=512,
                                                disk_mb=4096))
            task_text = h["task"]
        ctx.state["task_text"] = task_text
        wall = h["limits"]["wall_s"]
        # The sandbox outlives the agent's wall budget by the eval's and the endpoint's margins.
        spec.limits = Limits(**dict(spec.limits.to_dict(), wall_seconds=max(spec.limits.wall_seconds or 0,
                                                                            wall + 3600)))
        # Memory (docs/HARNESS.md, "Memory"): memory_mb bounds the sandbox's resident memory (a
        # cgroup where delegated); address_space_mb replaces the per-process RLIMIT_AS that is the
        # fallback, sized so Node harnesses (V8 reserves far more than it uses) run.
        mem = {k: h["limits"][k] for k in ("memory_mb", "address_space_mb") if h["limits"].get(k)}
        if mem:
            spec.limits = Limits(**dict(spec.limits.to_dict(), **mem))
        if setup["image"]:
            spec.image = setup["image"]
        spec.workspace_files = dict(spec.workspace_files, **setup["files"])
        spec.binds = list(spec.binds) + [(p, p, True) for p in self.agent_mounts()] + agent_script_binds()
        if "pytest" in h["eval"] and ctx.services.runtime().name != "local":
            # the grader's pytest (and its requirements), read-only, as the swe domain has it
            from rolloutd.handlers.tasks import pytest_binds

            spec.binds += [b for b in pytest_binds() if not any(b[1] == x[1] for x in spec.binds)]
        ctx.create_sandbox(spec)
        from rolloutd.handlers.tasks import give_to_sandbox

        ws = Path(ctx.sandbox["workspace"])
        if domain is not None:
            domain.prepare_sandbox(self.view(ctx))
        if setup["repository"]:
            shutil.copytree(self.config["repositories"][setup["repository"]], ws, dirs_exist_ok=True, symlinks=True)
            give_to_sandbox(ctx.sandbox, [ws])

    # -- run -----------------------------------------------------------------------------------
    def agent_call(self, ctx: JobContext, h: dict, base_url: str, api_key: str) -> dict:
        """The ``agent`` tool call for this job (argv, env, stdin, timeout)."""
        from rolloutd.handlers.tasks import give_to_sandbox, workspace_inside

        sb = ctx.sandbox
        inside_ws = workspace_inside(sb)
        task = ctx.state["task_text"]
        task_file = f"{inside_ws}/{TASK_FILE}"
        if h["task_via"] == "file" or any("{task_file}" in a for a in h["command"]):
            p = Path(sb["workspace"]) / TASK_FILE
            p.write_text(task, encoding="utf-8")
            give_to_sandbox(sb, [p])
        subst = {"{task}": task, "{task_file}": task_file, "{agent_dir}": AGENT_DIR,
                 "{max_llm_calls}": str(h["limits"].get("max_llm_calls") or 0),
                 "{model}": str(self.config.get("model_name", "rolloutd"))}
        argv = []
        for a in h["command"]:
            for k, v in subst.items():
                a = a.replace(k, v) if k != "{task}" or h["task_via"] == "arg" else a
            argv.append(a)
        venv = self.agent_venv()
        env = {"OPENAI_BASE_URL": base_url, "OPENAI_API_BASE": base_url, "OPENAI_API_KEY": api_key,
               "ROLLOUTD_TASK_FILE": task_file if h["task_via"] == "file" else "",
               "PATH": self.agent_path(), "PYTHONUNBUFFERED": "1"}
        if venv:
            env["VIRTUAL_ENV"] = venv
        fill = {"{agent_dir}": AGENT_DIR, "{base_url}": base_url, "{base_root}": base_url.removesuffix("/v1"),
                "{api_key}": api_key, "{model}": str(self.config.get("model_name", "rolloutd"))}

        def filled(v: str) -> str:
            for k, x in fill.items():
                v = v.replace(k, x)
            return v

        env.update({k: filled(v) for k, v in h["env"].items()})
        if h["home_files"]:  # written into the sandbox's own HOME by the launcher, then exec
            import json

            env["ROLLOUTD_HOME_FILES"] = json.dumps({k: filled(v) for k, v in h["home_files"].items()})
            argv = ["python3", "-I", f"{AGENT_DIR}/launch.py", "--"] + argv
        return {"argv": argv, "env": env, "cwd": h["cwd"] or inside_ws, "timeout": h["limits"]["wall_s"],
                "stdin": task if h["task_via"] == "stdin" else None, "tail_bytes": 16384,
                "log": f"{inside_ws}/.rolloutd_agent.log"}

    def endpoint_limits(self, ctx: JobContext, h: dict):
        from rolloutd.endpoint.bounds import EndpointLimits

        lim = h["limits"]
        left = [lim["wall_s"]]
        if ctx.job.budget_s is not None:  # the job's own budget: calls after it are refused
            left.append(max(0.0, ctx.job.budget_s - ctx.job.spent_s))
        return EndpointLimits(max_llm_calls=lim.get("max_llm_calls"), max_context=lim["max_context"],
                              max_tokens=lim["max_tokens"], deadline=time.monotonic() + min(left))

    async def run(self, ctx: JobContext):
        from rolloutd.handlers.tasks import give_to_sandbox
        from rolloutd.endpoint.app import make_app
        from rolloutd.endpoint.server import serve
        from rolloutd.endpoint.session import EndpointSession

        h = self.spec(ctx)
        sb = ctx.sandbox
        # Never block the run daemon's loop (its heartbeats stop, it is presumed dead and its
        # jobs' sandboxes reaped): the first tokenizer load and the uvicorn import take seconds.
        tok = await self.tokenizer_async(ctx)
        await asyncio.to_thread(importlib.import_module, "uvicorn")
        api_key = "rolloutd-" + secrets.token_hex(16)
        ctx.capture_tokens = False  # the endpoint's trajectory (segments, stop cuts) is copied on every path below
        session = EndpointSession(ctx.llm, tok, parser=h["parser"] or self.config.get("parser"),
                                  model=str(self.config.get("model_name", "rolloutd")),
                                  limits=self.endpoint_limits(ctx, h), api_key=api_key)
        sock = os.path.join(os.path.dirname(sb["tool_socket"]), LLM_SOCKET)
        inside_sock = sock if sb.get("runtime") == "local" else "/run/rolloutd/" + LLM_SOCKET
        app = record_requests(make_app(session), self.config.get("record_requests"), ctx.job.job_id, ctx.attempt)
        server = await serve(app, uds=sock)
        client = ctx.tools()
        outcome = "cancelled"
        try:
            give_to_sandbox(sb, [sock])
            r = await client.call("relay", {"socket": inside_sock}, timeout=30)
            if r.error:
                raise RuntimeError(f"cannot relay the LLM endpoint into the sandbox: {r.error}")
            call = await asyncio.to_thread(self.agent_call, ctx, h, r.output + "/v1", api_key)
            t0 = time.monotonic()
            res = await client.call("agent", call, timeout=call["timeout"])
            outcome = "done"
        finally:
            if outcome != "done":
                session.cancel("cancelled")  # refuse new calls, abort the backend request in flight
            await client.close()
            await server.stop()
            await _settled(session)
            _copy_trajectory(ctx, session)
        agent = {"exit_code": res.exit_code, "timed_out": res.timed_out, "duration_s": round(time.monotonic() - t0, 3),
                 "output_tail": (res.output or "")[-TAIL_CHARS:], "output_bytes": res.info.get("output_bytes"),
                 "error": res.error}
        ctx.trajectory["eval_details"]["agent"] = agent
        ctx.trajectory["metrics"]["agent_exit_code"] = res.exit_code
        ctx.trajectory["metrics"]["tokenizer"] = self.tokenizer_path(ctx)  # what decodes the ids (rolloutd view)
        if session.fatal is not None:  # e.g. StaleLease: the run daemon's staleness policy decides
            raise session.fatal
        if res.timed_out:
            raise PhaseTimeout("run (agent wall budget)", h["limits"]["wall_s"])
        if res.error or res.exit_code != 0:
            what = res.error or (f"killed by signal {-res.exit_code}" if (res.exit_code or 0) < 0
                                 else f"exit code {res.exit_code}")
            answered = graded_after_exit(res, session)
            if answered is None:
                raise AgentExited(f"the agent {h['command'][0]} failed ({what}); output tail:\n{agent['output_tail'][-1500:]}")
            # Not a failure: an exit gains nothing (kill $PPID) and a program bug costs no trajectory.
            ctx.trajectory["eval_details"]["reason"] = (
                f"the agent {h['command'][0]} ended with {what} after {answered} answered LLM "
                f"call{'s' if answered != 1 else ''}; its workspace was graded as it was left")

    # -- eval ----------------------------------------------------------------------------------
    async def eval(self, ctx: JobContext):
        h = self.spec(ctx)
        ev = h["eval"]
        if "scorer" in ev:
            d = await asyncio.to_thread(self.domain, ev["scorer"])  # imports, grader set-up: off the loop
            v = self.view(ctx)
            ctx.state["final_text"] = final_text(ctx.trajectory, await self.tokenizer_async(ctx))
            reward, details = await d.evaluate(v)
        elif "pytest" in ev:
            reward, details = await self._eval_pytest(ctx, ev)
        else:
            reward, details = await self._eval_command(ctx, ev)
        ctx.set_reward(reward, **details)

    def _prepare_grade(self, ctx: JobContext, ev: dict, pytest_mode: bool) -> dict:
        """After the purge (no agent process alive): put ``eval.restore`` back from the setup, write
        ``eval.files``, and for pytest sweep every conftest.py the host did not put there and pin
        the ini file. Raises AgentFault when the agent's tree stops it (full, too deep, unreadable)."""
        import errno
        import tempfile

        from rolloutd.handlers import pytest_grader
        from rolloutd.handlers.base import AgentFault
        from rolloutd.handlers.tasks import give_to_sandbox

        h = self.spec(ctx)
        ws = Path(ctx.sandbox["workspace"])
        out: dict[str, Any] = {"restored": [], "written": sorted(ev.get("files") or {})}
        try:
            with tempfile.TemporaryDirectory(prefix="rolloutd-eval-") as tmp:
                pristine, written = Path(tmp, "setup"), Path(tmp, "files")
                for root, files in ((pristine, h["setup"]["files"]), (written, ev.get("files") or {})):
                    root.mkdir()
                    for rel, text in files.items():
                        rel = pytest_grader.check_rel(rel)  # validated at init; a host path never escapes tmp
                        (root / rel).parent.mkdir(parents=True, exist_ok=True)
                        (root / rel).write_text(text, encoding="utf-8")
                repo = h["setup"]["repository"]
                restore = list(ev.get("restore") or [])
                if repo:  # the repository overlays setup.files, as in init
                    root = Path(self.config["repositories"][repo])
                    pytest_grader.restore_paths(root, pristine, [r for r in restore if os.path.lexists(root / r)])
                out["restored"] = pytest_grader.restore_paths(pristine, ws, restore)
                pytest_grader.restore_paths(written, ws, out["written"])
                if pytest_mode:
                    keep = {r for r in out["written"] if os.path.basename(r) == "conftest.py"}
                    for r in out["restored"]:
                        base = pristine / r
                        keep |= ({r} if base.name == "conftest.py" else
                                 {f"{r}/{q.relative_to(base)}" for q in base.rglob("conftest.py")} if base.is_dir() else set())
                    out["conftests_removed"] = pytest_grader.sweep_conftests(ws, keep)
                    out["pytest_config"] = pytest_grader.pin_config(ws, ev.get("pytest_config"))
        except OSError as e:
            if e.errno not in AGENT_ERRNOS:
                raise
            raise AgentFault(f"the grader's files could not be put into the agent's workspace: {e.strerror or e}") from e
        paths = out["restored"] + out["written"] + ([out["pytest_config"]] if pytest_mode else [])
        give_to_sandbox(ctx.sandbox, [ws / r for r in paths])
        return out

    async def _graded_files(self, ctx: JobContext, ev: dict, pytest_mode: bool) -> tuple[dict | None, dict]:
        """(what _prepare_grade did, or None when the agent's tree stopped it; details so far)."""
        from rolloutd.handlers.base import AgentFault

        if not pytest_mode and not ev.get("files") and not ev.get("restore"):
            return {}, {}
        await ctx.purge()  # no agent process may see or rewrite what the host writes next
        try:
            return await asyncio.to_thread(self._prepare_grade, ctx, ev, pytest_mode), {}
        except AgentFault as e:
            return None, {"reason": str(e)}

    async def _eval_command(self, ctx: JobContext, ev: dict) -> tuple[float, dict]:
        from rolloutd.handlers.tasks import SANDBOX_PATH, workspace_inside

        prepared, details = await self._graded_files(ctx, ev, False)
        if prepared is None:
            return 0.0, details
        details.update(prepared)
        warning = command_warning(ev)
        if warning:
            details["eval_warning"] = warning
        # The grade tool: the agent's processes are all dead first, the output is the eval
        # command's own (issue 24).
        r = await ctx.grade(ev["command"], timeout=ev["timeout_s"], cwd=workspace_inside(ctx.sandbox),
                            env={"PATH": SANDBOX_PATH, "HOME": "/tmp", "OPENAI_API_KEY": ""})
        out = r.output or ""
        details.update(eval_exit_code=r.exit_code, eval_timed_out=r.timed_out, eval_output=out[-TAIL_CHARS:])
        if r.error:
            details["eval_error"] = r.error
        why = grade_failure(r)
        if ev.get("reward", "exit_code") == "exit_code":
            if why and r.exit_code != 0:
                details["reason"] = why
            return (1.0 if r.exit_code == 0 and not r.timed_out and not r.error else 0.0), details
        return stdout_reward(out, details, why)

    async def _eval_pytest(self, ctx: JobContext, ev: dict) -> tuple[float, dict]:
        from rolloutd.handlers import pytest_grader
        from rolloutd.handlers.tasks import workspace_inside

        prepared, details = await self._graded_files(ctx, ev, True)
        if prepared is None:
            return 0.0, details
        details.update(prepared)
        if not ev["restore"] and not ev["files"]:  # eval.restore = [], or a setup.domain (no setup copy)
            details["eval_warning"] = ("eval.pytest restored and wrote nothing: the tests it ran were the agent's "
                                       "to change (name eval.files or eval.restore)")
        inside = workspace_inside(ctx.sandbox)
        end = f"ROLLOUTD-PYTEST-END-{secrets.token_hex(16)}"
        argv = pytest_grader.argv(ev["pytest"], rootdir=inside, config=prepared["pytest_config"])
        r = await ctx.grade(argv, timeout=ev["timeout_s"], cwd=inside, env=pytest_grader.env(ctx.sandbox, end))
        output, status = pytest_grader.split_at_end(r.output or "", end)
        details.update(eval_exit_code=r.exit_code, eval_timed_out=r.timed_out, eval_status=status,
                       eval_output=(output or r.output or "")[-TAIL_CHARS:])
        if r.error:
            details["eval_error"] = r.error
        passed = status == 0 and r.exit_code == 0 and not r.timed_out and not r.error
        if not passed:
            why = grade_failure(r) or (None if status is not None else "pytest ended without its end line")
            if why:
                details["reason"] = why
        return (1.0 if passed else 0.0), details




# Answers the endpoint gave that say nothing outside the agent failed: 505 is the client's own
# HTTP version. Every other 5xx (backend unavailable or aborting, deadline, cancel, endpoint bug) may be.
AGENT_5XX = ("505",)


def graded_after_exit(res, session) -> int | None:
    """How many LLM calls were answered when an agent program that ended non-zero is graded
    anyway (docs/RELIABILITY.md, "No abstention"); None when its job fails (``AgentExited``):
    the tool could not run it, no call was answered, the session hit a fatal error, or an answer
    was a 5xx (a backend, endpoint or deadline failure the program may have exited of)."""
    if res.error or session.fatal is not None:
        return None
    answered = sum(s.n_turns for s in session.segments)
    server = [k for k in session.metrics["refused_by_status"] if k.startswith("5") and k.split()[0] not in AGENT_5XX]
    return answered if answered and not server else None


def command_warning(ev: dict) -> str | None:
    """Why an ``eval.command`` grade is open to the agent (docs/HARNESS.md, "Grading"), or None."""
    out = []
    runs_pytest = any(os.path.basename(a) in ("pytest", "py.test") or a == "pytest" for a in ev["command"])
    if runs_pytest:
        out.append("eval.command runs pytest without the grader's hardening: a conftest.py, pytest.ini, pytest.py "
                   "or edited test of the agent's decides its result; use eval.pytest")
    elif not ev.get("files") and not ev.get("restore"):
        out.append("eval.command ran over a workspace the agent could edit, with nothing written (eval.files) or "
                   "restored (eval.restore) after the purge: its tests were the agent's to change")
    if ev.get("reward") == "stdout":
        out.append("reward 'stdout' is the command's last stdout line, whoever prints it: code of the agent's that "
                   "the command imports can print after the scorer (atexit); run that code in a subprocess")
    return "; ".join(out) or None


def grade_failure(r) -> str | None:
    """Why a grade gave no result the grader chose (a killed or timed-out grader, one that could not
    start in the agent's workspace): each the agent's doing or its code's, so reward 0 with this."""
    if r.timed_out:
        return "the grader ran out of time (the code under test did not finish)"
    if r.error:
        return f"the grader could not run in the agent's workspace: {r.error}"
    if (r.exit_code or 0) < 0:
        return f"the grader was killed by signal {-r.exit_code} (the code under test)"
    return None


STDOUT_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?|[+-]?(?:nan|inf|infinity)",
                           re.ASCII | re.IGNORECASE)


def stdout_reward(out: str, details: dict, why: str | None) -> tuple[float, dict]:
    """``reward: "stdout"``: the number on the last line. What the agent's code made of that line (no
    number, NaN, inf, past +-REWARD_BOUND) is reward 0 with the reason, never a NaN reward."""
    from rolloutd.handlers.base import InvalidReward, check_reward

    lines = out.strip().splitlines()
    if why:
        details["reason"] = why
        return 0.0, details
    try:  # a plain ASCII decimal: not what float() also takes ('1_0' is 10, Arabic-Indic digits, ' nan ')
        if not STDOUT_NUMBER.fullmatch(lines[-1].strip()):
            raise ValueError(lines[-1][:100])
        value = float(lines[-1])
    except (IndexError, ValueError):
        details["eval_reward_error"] = details["reason"] = "the eval command's last stdout line is not a number"
        return 0.0, details
    try:
        return check_reward(value, "the eval command's last stdout line"), details
    except InvalidReward as e:
        details["eval_reward_error"] = details["reason"] = str(e)
        return 0.0, details


async def _settled(session, timeout_s: float = 30.0) -> None:
    """Wait for the endpoint's thread work of requests the server stop cancelled (a placement, a
    long reply's parse): it changes the conversations the trajectory is read from."""
    try:
        async with asyncio.timeout(timeout_s):
            await session.settled()
    except TimeoutError:
        log.warning("endpoint_thread_work_outlived_job", timeout_s=timeout_s)


def _copy_trajectory(ctx: JobContext, session) -> None:
    """What the endpoint recorded, into the job's trajectory (also after a crash or cancel)."""
    try:
        t = session.trajectory()
    except Exception as e:  # noqa: BLE001 - the job's own failure matters more than this one
        ctx.trajectory["metrics"]["trajectory_error"] = f"{type(e).__name__}: {e}"
        return
    metrics = t.pop("metrics", None) or {}
    ctx.trajectory.update(t)
    ctx.trajectory["metrics"].update(metrics)


def final_text(traj: dict, tok) -> str:
    """The text of the last assistant turn (what a domain scorer grades)."""
    turns = traj.get("turns") or []
    if not turns:
        return ""
    s, e = turns[-1].get("span") or (turns[-1]["start"], turns[-1]["end"])
    ids = [int(x) for x in list(traj["response_ids"])[s:e]]
    return tok.decode(ids, skip_special_tokens=True)
