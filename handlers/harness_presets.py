"""Presets of the ``harness`` handler, the agent virtual environment, and the oracle for mini-swe-agent.

Presets (an instance says ``"preset": NAME`` and may override ``command``, ``env``, ``limits``):

* ``mini-swe-agent``: the ``mini`` CLI of the PyPI package ``mini-swe-agent`` (v2) with its
  text-based config (``mini_textbased.yaml``: one ```` ```mswea_bash_command ```` block per
  reply, ``echo COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT`` to finish), the LiteLLM text model on
  ``openai/rolloutd`` (LiteLLM reads ``OPENAI_BASE_URL`` / ``OPENAI_API_KEY``), no confirmation
  (``-y --exit-immediately``), no cost limit, its step limit = ``max_llm_calls``, no model retries
  (a refused call ends the run instead of backing off for minutes), LiteLLM's model cost map
  from the package (``LITELLM_LOCAL_MODEL_COST_MAP``: never fetched from the network).
* ``openai-tools``: ``openai_tool_loop.py`` (next to this file, mounted read-only at
  ``/opt/rolloutd-agents``): the ``openai`` SDK's chat-completions tool-calling loop with ``bash``
  and ``python`` tools, the task on stdin, the final answer printed.

The agent venv: ``build_agent_venv(DIR)`` (or ``python -m rolloutd.handlers.harness_presets
venv DIR``) makes a virtual environment from the system ``python3`` (the interpreter the
sandbox sees under ``/usr``) and pip-installs ``mini-swe-agent`` and ``openai`` into it. The
handler mounts it read-only at the same path (``[handlers.harness] agent_venv``).

``MiniSWEOracle`` (policy ``mini_swe_oracle``): for the scripted backend, solves the SWE tasks
as mini-swe-agent expects: a bash block that applies the task's fix (or its wrong fix), one
that runs a failing test, then the submit command. ``HarnessOracle`` (``harness_oracle``): that
for mini-swe-agent prompts, the domain oracle (hermes tool calls) for everything else.
"""
from __future__ import annotations

import hashlib
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rolloutd.backends.policies import Policy, PolicyRequest

AGENT_DIR = "/opt/rolloutd-agents"
_SCRIPTS = Path(__file__).resolve().parent / "harness_agents"
PYPI_PACKAGES: dict[str, str] = {"aider": "aider-chat==0.86.2"}  # preset -> pinned PyPI harness
AGENT_PACKAGES = ("mini-swe-agent", "openai", *PYPI_PACKAGES.values())
MINI_SUBMIT = "COMPLETE_TASK_AND_SUBMIT_FINAL_OUTPUT"

PRESETS: dict[str, dict[str, Any]] = {
    "mini-swe-agent": {
        "command": ["mini", "-c", "mini_textbased.yaml", "-c", "agent.step_limit={max_llm_calls}",
                    "-c", "model.model_kwargs.temperature=1.0",
                    "--model-class", "litellm_textbased", "-m", "openai/rolloutd", "-y", "--exit-immediately",
                    "-l", "0", "-o", "/tmp/mini.traj.json", "-t", "{task}"],
        "env": {"MSWEA_CONFIGURED": "1", "MSWEA_COST_TRACKING": "ignore_errors", "MSWEA_SILENT_STARTUP": "1",
                "MSWEA_GLOBAL_CONFIG_DIR": "/tmp/mswea", "MSWEA_MODEL_RETRY_STOP_AFTER_ATTEMPT": "1",
                "LITELLM_LOCAL_MODEL_COST_MAP": "True", "LITELLM_TELEMETRY": "False",
                "HF_HUB_OFFLINE": "1", "TERM": "dumb", "NO_COLOR": "1", "COLUMNS": "200"},
        "task_via": "arg",
        "limits": {"max_llm_calls": 30},
    },
    "openai-tools": {
        "command": ["python", "{agent_dir}/openai_tool_loop.py", "--max-turns", "{max_llm_calls}"],
        "env": {},
        "task_via": "stdin",
        "limits": {"max_llm_calls": 12},
    },
}

# -- the real coding harnesses, unmodified, pinned -------------------------------------------------
# Each: its registry package at a pinned version (installed by `python -m
# rolloutd.handlers.harness_presets venv DIR`: npm ones into DIR/node, PyPI ones into the venv),
# headless, its own writable HOME on the sandbox's tmpfs with its config written there by
# launch.py (base URL and key are the job's endpoint, filled in at run time), nothing that
# reaches the network (telemetry, update checks, model lists, pricing), and its own approval
# prompts and nested sandbox off: our sandbox is the boundary. docs/HARNESS.md has the table.
HOME = "/tmp/rolloutd-home"
_XDG = {"XDG_CONFIG_HOME": HOME + "/.config", "XDG_DATA_HOME": HOME + "/.local/share",
        "XDG_CACHE_HOME": HOME + "/.cache", "XDG_STATE_HOME": HOME + "/.local/state"}
_NODE_ENV = dict({"HOME": HOME, "TERM": "dumb", "NO_COLOR": "1", "CI": "1", "NO_UPDATE_NOTIFIER": "1",
                  "NPM_CONFIG_UPDATE_NOTIFIER": "false", "DO_NOT_TRACK": "1"}, **_XDG)
# V8 reserves far more address space than it uses (WebAssembly guard regions for fetch's
# llhttp, the pointer cage): resident memory bounded by memory_mb (a cgroup where delegated),
# the per-process address-space fallback sized so every pinned Node harness starts.
_NODE_LIMITS = {"max_llm_calls": 30, "max_context": 262144, "max_tokens": 4096, "memory_mb": 4096,
                "address_space_mb": 65536}


def _json(obj: Any) -> str:
    return json.dumps(obj, indent=2) + "\n"


NPM_PACKAGES: dict[str, str] = {  # preset -> pinned npm package
    "claude-code": "@anthropic-ai/claude-code@2.1.332",
    "codex": "@openai/codex@0.171.0",
    "gemini-cli": "@google/gemini-cli@0.61.0",
    "qwen-code": "@qwen-code/qwen-code@0.24.4",
    "opencode": "opencode-ai@1.18.33",
    "pi": "@mariozechner/pi-coding-agent@0.73.1",
}
# The API shape each preset speaks to the endpoint (routes: docs/HARNESS.md).
PRESET_API = {"mini-swe-agent": "chat-completions", "openai-tools": "chat-completions",
              "qwen-code": "chat-completions", "opencode": "chat-completions", "pi": "chat-completions",
              "aider": "chat-completions", "claude-code": "anthropic-messages", "codex": "openai-responses",
              "gemini-cli": "gemini"}

# Claude Code refuses model names it does not know ("unrecognized_model"): it asks for a Claude
# model name, which the endpoint accepts like any other (replies name the served model).
CLAUDE_MODEL = "claude-sonnet-4-5"

PRESETS.update({
    "qwen-code": {
        # Chat Completions with OPENAI_* from the environment (auth type openai); --yolo: every tool
        # call runs without asking; its optional bwrap sandbox stays off (tools.sandbox false).
        "command": ["qwen", "-p", "{task}", "--output-format", "json", "--yolo", "--auth-type", "openai",
                    "-m", "{model}"],  # no --max-session-turns: the endpoint's spent-budget reply ends the run (exit 0)
        "env": dict(_NODE_ENV, OPENAI_MODEL="{model}", QWEN_CODE_SUPPRESS_YOLO_WARNING="1",
                    QWEN_CODE_NO_RELAUNCH="1"),
        "home_files": {".qwen/settings.json": _json({
            "security": {"auth": {"selectedType": "openai"}, "folderTrust": {"enabled": False}},
            "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True, "checkpointing": {"enabled": False}},
            "tools": {"sandbox": False}, "ide": {"enabled": False},
            "model": {"name": "{model}"}})},
        "task_via": "arg",
        "limits": dict(_NODE_LIMITS),
    },
    "opencode": {
        # A provider on @ai-sdk/openai-compatible at the endpoint, the same model as its small model
        # (session titles), permissions all "allow", sharing, auto-update, model list fetch, LSP
        # downloads and default plugins off.
        "command": ["opencode", "run", "--format", "json", "-m", "rolloutd/{model}", "{task}"],
        "env": dict(_NODE_ENV, OPENCODE_DISABLE_AUTOUPDATE="1", OPENCODE_DISABLE_MODELS_FETCH="1",
                    OPENCODE_DISABLE_LSP_DOWNLOAD="1", OPENCODE_DISABLE_DEFAULT_PLUGINS="1",
                    OPENCODE_DISABLE_SHARE="1", OPENCODE_DISABLE_CLAUDE_CODE="1"),
        "home_files": {".config/opencode/opencode.json": _json({
            "$schema": "https://opencode.ai/config.json",
            "provider": {"rolloutd": {"npm": "@ai-sdk/openai-compatible", "name": "rolloutd",
                                      "options": {"baseURL": "{base_url}", "apiKey": "{api_key}"},
                                      "models": {"{model}": {"name": "{model}"}}}},
            "model": "rolloutd/{model}", "small_model": "rolloutd/{model}",
            "autoupdate": False, "share": "disabled",
            "permission": {"edit": "allow", "bash": "allow", "webfetch": "deny"}})},
        "task_via": "arg",
        "limits": dict(_NODE_LIMITS),
    },
    "pi": {
        # One provider on the endpoint in openai-completions mode (pi also speaks
        # openai-responses, anthropic-messages and google-generative-ai: set "api" to try another).
        "command": ["pi", "-p", "--mode", "json", "--no-session", "--model", "rolloutd/{model}", "{task}"],
        "env": dict(_NODE_ENV, PI_OFFLINE="1", PI_SKIP_VERSION_CHECK="1", PI_TELEMETRY="0"),
        "home_files": {".pi/agent/models.json": _json({"providers": {"rolloutd": {
            "baseUrl": "{base_url}", "api": "openai-completions", "apiKey": "{api_key}",
            "models": [{"id": "{model}", "contextWindow": 262144, "maxTokens": 4096}]}}})},
        "task_via": "arg",
        "limits": dict(_NODE_LIMITS),
    },
    "claude-code": {
        # Anthropic Messages at ANTHROPIC_BASE_URL (the endpoint's root); nonessential traffic
        # (title calls, api.anthropic.com look-ups), telemetry, auto-update, error reports off;
        # every tool allowed without asking (bypassPermissions: our sandbox is the boundary).
        "command": ["claude", "-p", "{task}", "--output-format", "json", "--model", CLAUDE_MODEL,
                    "--permission-mode", "bypassPermissions"],  # no --max-turns: the spent-budget reply ends it
        "env": dict(_NODE_ENV, ANTHROPIC_BASE_URL="{base_root}", ANTHROPIC_API_KEY="{api_key}",
                    ANTHROPIC_DEFAULT_HAIKU_MODEL=CLAUDE_MODEL, ANTHROPIC_SMALL_FAST_MODEL=CLAUDE_MODEL,
                    CLAUDE_CODE_DISABLE_NONESSENTIAL_TRAFFIC="1", DISABLE_TELEMETRY="1",
                    DISABLE_AUTOUPDATER="1", DISABLE_ERROR_REPORTING="1", DISABLE_BUG_COMMAND="1",
                    CLAUDE_CODE_DISABLE_TERMINAL_TITLE="1", IS_SANDBOX="1"),
        "home_files": {".claude.json": _json({"hasCompletedOnboarding": True, "bypassPermissionsModeAccepted": True,
                                              "autoUpdates": False})},
        "task_via": "arg",
        "limits": dict(_NODE_LIMITS),
    },
    "codex": {
        # A model provider on the Responses API at the endpoint, key from ROLLOUTD_CODEX_KEY;
        # update checks, analytics, feedback off; its own sandbox (bwrap/landlock, which cannot
        # start inside ours) and approvals off: --dangerously-bypass-approvals-and-sandbox.
        "command": ["codex", "exec", "--skip-git-repo-check", "--json", "--dangerously-bypass-approvals-and-sandbox",
                    "-m", "{model}", "{task}"],
        "env": dict(_NODE_ENV, ROLLOUTD_CODEX_KEY="{api_key}", CODEX_HOME=HOME + "/.codex"),
        "home_files": {".codex/config.toml": (
            'model = "{model}"\nmodel_provider = "rolloutd"\ncheck_for_update_on_startup = false\n'
            '\n[model_providers.rolloutd]\nname = "rolloutd"\n'
            'base_url = "{base_url}"\nwire_api = "responses"\nenv_key = "ROLLOUTD_CODEX_KEY"\n'
            'request_max_retries = 0\nstream_max_retries = 0\n\n[analytics]\nenabled = false\n\n'
            '[feedback]\nenabled = false\n\n[otel]\nexporter = "none"\n')},
        "task_via": "arg",
        "limits": dict(_NODE_LIMITS),
    },
    "gemini-cli": {
        # The Gemini API at GOOGLE_GEMINI_BASE_URL with an API key; folder trust, usage statistics,
        # telemetry, auto-update off; --yolo; -m names the model (without it: a routing call first).
        "command": ["gemini", "-p", "{task}", "--output-format", "json", "--yolo", "-m", "{model}"],
        "env": dict(_NODE_ENV, GEMINI_API_KEY="{api_key}", GOOGLE_GEMINI_BASE_URL="{base_root}",
                    GEMINI_CLI_TRUST_WORKSPACE="true", GEMINI_CLI_NO_RELAUNCH="true",
                    NODE_OPTIONS="--disable-wasm-trap-handler"),
        "home_files": {".gemini/settings.json": _json({
            "security": {"auth": {"selectedType": "gemini-api-key"}, "folderTrust": {"enabled": False}},
            "privacy": {"usageStatisticsEnabled": False}, "telemetry": {"enabled": False},
            "general": {"disableAutoUpdate": True, "disableUpdateNag": True}, "tools": {"sandbox": False},
            "ide": {"enabled": False}})},
        "task_via": "arg",
        "limits": dict(_NODE_LIMITS),
    },
    "aider": {
        # Aider's own edit format (SEARCH/REPLACE blocks: no tools), one message then exit; no git,
        # no auto-commits, lint or test runs, no update check, analytics or model-warning look-ups;
        # LiteLLM's openai/ provider reads OPENAI_API_BASE/OPENAI_API_KEY, its cost map from the
        # package.
        "command": ["aider", "--model", "openai/{model}", "--edit-format", "diff", "--message", "{task}",
                    "--yes-always", "--no-git", "--no-auto-commits", "--no-auto-lint", "--no-auto-test",
                    "--no-check-update", "--no-analytics", "--no-show-model-warnings", "--map-tokens", "0",
                    "--no-pretty", "--no-fancy-input", "--no-stream", "--no-detect-urls", "--no-gitignore",
                    "--no-show-release-notes", "--no-suggest-shell-commands"],
        "env": dict({"HOME": HOME, "TERM": "dumb", "NO_COLOR": "1", "LITELLM_LOCAL_MODEL_COST_MAP": "True",
                     "LITELLM_TELEMETRY": "False", "HF_HUB_OFFLINE": "1", "AIDER_ANALYTICS_DISABLE": "true"}, **_XDG),
        # Its model metadata (context size, zero prices) from a file in HOME, so aider never
        # fetches LiteLLM's price list from the network (LITELLM_LOCAL_MODEL_COST_MAP covers only
        # LiteLLM's own look-up).
        "home_files": {".aider.model.metadata.json": _json({"openai/{model}": {
            "max_input_tokens": 65536, "max_output_tokens": 4096, "input_cost_per_token": 0.0,
            "output_cost_per_token": 0.0, "litellm_provider": "openai", "mode": "chat"}})},
        "task_via": "arg",
        "limits": {"max_llm_calls": 10, "max_context": 65536, "max_tokens": 4096},
    },
})


def agent_scripts_dir() -> str:
    """A world-readable copy of harness_agents/ (content-addressed, made atomically): the sandbox
    may run as another uid that cannot read the checkout."""
    files = sorted(p for p in _SCRIPTS.glob("*.py"))
    h = hashlib.sha256()
    for p in files:
        h.update(p.name.encode() + b"\0" + p.read_bytes())
    d = Path(tempfile.gettempdir()) / f"rolloutd-agents-{os.getuid()}-{h.hexdigest()[:12]}"
    if d.is_dir():
        return str(d)
    tmp = Path(tempfile.mkdtemp(prefix=".rolloutd-agents-", dir=tempfile.gettempdir()))
    for p in files:
        shutil.copy2(p, tmp / p.name)
        os.chmod(tmp / p.name, 0o644)
    os.chmod(tmp, 0o755)
    try:
        os.rename(tmp, d)
    except OSError:  # another process made it first; identical content
        shutil.rmtree(tmp, ignore_errors=True)
    return str(d)


def agent_script_binds() -> list[tuple[str, str, bool]]:
    return [(agent_scripts_dir(), AGENT_DIR, True)]


def record_requests(app, directory: str | None, job_id: str, attempt: int = 1):
    """The endpoint's ASGI app, with every request (method, path, API shape, query, status, body,
    and the job's attempt: a re-dispatched job's runs share the file) appended to
    ``directory/<job_id>.jsonl`` when ``[handlers.harness] record_requests`` names a
    directory: what the harness really sent, refused requests included (a 401 on a harness's side
    traffic), for tests that check each prompt against the chat template's rendering of that
    request (and for debugging a preset). Off (the app itself) by default."""
    if not directory:
        return app
    from rolloutd.endpoint.app import api_shape

    os.makedirs(directory, exist_ok=True)
    path = os.path.join(directory, f"{job_id}.jsonl")

    async def recorded(scope, receive, send):
        if scope["type"] != "http" or scope.get("path") == "/health":
            return await app(scope, receive, send)
        msgs, chunks = [], []
        while True:
            m = await receive()
            msgs.append(m)
            if m["type"] != "http.request":
                break
            chunks.append(m.get("body", b""))
            if not m.get("more_body"):
                break
        status: dict[str, int] = {}
        pending = iter(msgs)

        async def replay():
            return next(pending, None) or await receive()

        async def send_status(m):
            if m["type"] == "http.response.start":
                status["code"] = m["status"]
            await send(m)

        try:
            await app(scope, replay, send_status)
        finally:
            row = {"method": scope.get("method"), "path": scope.get("path"), "shape": api_shape(scope.get("path", "")),
                   "query": scope.get("query_string", b"").decode("latin-1"),
                   "status": status.get("code"), "body": b"".join(chunks).decode("utf-8", "replace"),
                   "attempt": attempt}
            with open(path, "a", encoding="utf-8") as f:
                f.write(json.dumps(row) + "\n")

    return recorded


# -- the agent venv --------------------------------------------------------------------------------
NODE_SUBDIR = "node"  # the npm harnesses' cache inside the agent venv (mounted with it)


def node_bin(venv: str | os.PathLike) -> str:
    return os.path.join(str(venv), NODE_SUBDIR, "node_modules", ".bin")


def system_python() -> str:
    """The interpreter a bwrap sandbox sees: the host's /usr/bin/python3 (/usr is mounted)."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    raise RuntimeError("no system python3 under /usr: the sandbox could not run the agent venv")


def _marker(packages, npm) -> dict:
    return {"packages": list(packages), "npm": list(npm)}


def venv_ready(path: str | os.PathLike, packages=AGENT_PACKAGES, npm=None) -> bool:
    npm = tuple(NPM_PACKAGES.values()) if npm is None else npm
    marker = Path(path) / ".rolloutd-agent-venv"
    try:
        return marker.is_file() and json.loads(marker.read_text()) == _marker(packages, npm)
    except ValueError:
        return False


def build_agent_venv(path: str | os.PathLike, packages=AGENT_PACKAGES, python: str | None = None,
                     quiet: bool = True, npm=None) -> str:
    """Make (or reuse) the agent venv at ``path``: ``packages`` from PyPI (mini-swe-agent, openai
    and the PyPI harnesses at their pinned versions), and the npm harnesses (``npm``, default every
    pinned one of :data:`NPM_PACKAGES`) into ``path/node`` with the machine's npm (Node >= 20).
    World-readable (its parent directories must be searchable by the sandbox's uid: not under
    /root). A venv whose recorded package lists match is reused as it is. Returns the path."""
    npm = tuple(NPM_PACKAGES.values()) if npm is None else tuple(npm)
    path = Path(path).resolve()
    if venv_ready(path, packages, npm):
        return str(path)
    python = python or system_python()
    if npm and shutil.which("npm") is None:
        raise RuntimeError("npm is not installed: the Node harnesses (%s) need Node >= 20 and npm"
                           % ", ".join(sorted(NPM_PACKAGES)))
    (path / ".rolloutd-agent-venv").unlink(missing_ok=True)
    if not (path / "bin" / "python").exists() or not venv_ready_python(path, packages):
        subprocess.run([python, "-m", "venv", "--clear", str(path)], check=True)
        pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
        if quiet:
            pip.append("-q")
        subprocess.run(pip + list(packages), check=True)
        (path / ".rolloutd-pip").write_text(json.dumps(list(packages)))
    if npm:
        node = path / NODE_SUBDIR
        node.mkdir(exist_ok=True)
        cmd = ["npm", "install", "--prefix", str(node), "--no-audit", "--no-fund", "--no-update-notifier",
               "--loglevel=error", *npm]
        subprocess.run(cmd, check=True, stdout=subprocess.DEVNULL if quiet else None)
    from rolloutd.sandbox.runtime import make_world_readable

    make_world_readable(path)  # the sandbox binds it read-only and may run as nobody
    (path / ".rolloutd-agent-venv").write_text(json.dumps(_marker(packages, npm)))
    return str(path)


def venv_ready_python(path: Path, packages) -> bool:
    """The venv's PyPI part is already the one asked for (only the npm part changed)."""
    try:
        return json.loads((path / ".rolloutd-pip").read_text()) == list(packages)
    except (OSError, ValueError):
        return False


# -- the oracle for mini-swe-agent ----------------------------------------------------------------
class MiniSWEOracle(Policy):
    """Plays the SWE tasks in mini-swe-agent's text format (``wrong_every`` / ``mode`` as the
    domain oracles: see handlers/oracles.py)."""

    name = "mini_swe_oracle"

    def __init__(self, **options: Any) -> None:
        from rolloutd.handlers.oracles import Oracle

        super().__init__(**options)
        self._keys = Oracle(**options)  # its right-or-wrong rule

    def reply(self, request: PolicyRequest) -> str:
        from rolloutd.handlers.oracles import _test_prefix, assistant_turns
        from rolloutd.handlers.swe_tasks import get_task, task_ids
        from rolloutd.handlers.tasks import find_task_tag

        text = request.prompt_text
        tag = find_task_tag(text)
        if tag is None or tag[0] != "swe":
            return "I do not know this task.\n\n```mswea_bash_command\necho " + MINI_SUBMIT + "\n```"
        task = get_task(tag[1][0])
        step = assistant_turns(text)
        if step == 0:
            key = sorted(task_ids()).index(task["task_id"])
            edits = task["wrong_fix"] if self._keys.is_wrong(key) else task["oracle_fix"]
            return "I found the bug; let me fix it.\n\n" + _block(_apply_edits_command(edits))
        if step == 1:
            argv = _test_prefix(task["test_cmd"]) + [task["FAIL_TO_PASS"][0]]
            return "Let me run the failing test.\n\n" + _block(" ".join(shlex.quote(a) for a in argv)
                                                               + " 2>&1 | tail -n 3")
        return "The fix is in place; submitting.\n\n" + _block("echo " + MINI_SUBMIT)


_TOOLS_RE = re.compile(r"<tools>\n(.*?)\n</tools>", re.DOTALL)
# A harness's shell tool, by name (each preset's own: Qwen Code and Gemini CLI, Codex, OpenCode,
# Pi and Claude Code, Codex's older array form); else any tool whose schema has a command argument.
SHELL_TOOLS = ("run_shell_command", "exec_command", "bash", "Bash", "shell", "shell_command", "execute_bash",
               "terminal", "run_command")
TITLE_REPLY = "Fix the failing test"
AIDER_FIX = "I found the bug; here is the fix."


def offered_tools(prompt_text: str) -> list[dict]:
    """The function tools the chat template rendered into the prompt (hermes ``<tools>`` block:
    one JSON object a line), as ``{"name", "parameters"}``."""
    m = _TOOLS_RE.search(prompt_text)
    if m is None:
        return []
    out = []
    for line in m.group(1).splitlines():
        try:
            t = json.loads(line)
        except ValueError:
            continue
        f = t.get("function", t) if isinstance(t, dict) else None
        if isinstance(f, dict) and isinstance(f.get("name"), str):
            out.append({"name": f["name"], "parameters": f.get("parameters") or {}})
    return out


def shell_tool(tools: list[dict]) -> tuple[str, str, dict] | None:
    """(tool name, its command argument, its parameters schema) of the offered shell tool."""
    by_name = {t["name"]: t for t in tools}
    ordered = [by_name[n] for n in SHELL_TOOLS if n in by_name] + tools
    for t in ordered:
        props = (t["parameters"] or {}).get("properties") or {}
        for arg in ("command", "cmd"):
            if arg in props:
                return t["name"], arg, t["parameters"]
    return None


def shell_call(tools: list[dict], command: str, why: str) -> str | None:
    """A hermes tool call running ``command`` through the offered shell tool, every required
    argument filled (a string array where the tool takes argv, ``why`` for descriptions)."""
    from rolloutd.handlers.oracles import _call

    found = shell_tool(tools)
    if found is None:
        return None
    name, arg, schema = found
    props = schema.get("properties") or {}
    args: dict[str, Any] = {arg: ["bash", "-lc", command] if props[arg].get("type") == "array" else command}
    for req in schema.get("required") or []:
        if req in args:
            continue
        typ = (props.get(req) or {}).get("type")
        args[req] = {"boolean": False, "integer": 120000, "number": 120000, "array": []}.get(typ, why)
    return _call(name, args)


def aider_blocks(edits: list[dict]) -> str:
    """Aider's SEARCH/REPLACE blocks for ``[{path, old, new}]``."""
    return "\n".join(f"{e['path']}\n```\n<<<<<<< SEARCH\n{e['old'].rstrip(chr(10))}\n=======\n"
                     f"{e['new'].rstrip(chr(10))}\n>>>>>>> REPLACE\n```\n" for e in edits)


class PresetOracle(Policy):
    """Plays the SWE tasks with whatever harness sent the prompt, through that harness's own tools:
    the shell tool it offers (read from the ``<tools>`` block the chat template rendered: Qwen Code's
    and Gemini CLI's ``run_shell_command``, OpenCode's and Pi's ``bash``, Claude Code's ``Bash``,
    Codex's ``exec_command``), answered as the model family's tool call (hermes): the fix (or the
    wrong fix) as one command, then the failing test, then a final answer without a call, which
    ends a headless run. Aider (no tools; its edit format in the system prompt) gets SEARCH/REPLACE
    blocks. A prompt without tools that is not aider's (a harness's side call: a session title)
    gets a short title."""

    name = "preset_oracle"

    def __init__(self, **options: Any) -> None:
        from rolloutd.handlers.oracles import Oracle

        super().__init__(**options)
        self._keys = Oracle(**options)

    def reply(self, request: PolicyRequest) -> str:
        from rolloutd.handlers.oracles import _test_prefix, assistant_turns
        from rolloutd.handlers.swe_tasks import get_task, task_ids
        from rolloutd.handlers.tasks import find_task_tag

        text = request.prompt_text
        tools = offered_tools(text)
        tag = find_task_tag(text)
        aider = not tools and "SEARCH/REPLACE" in text
        if not tools and not aider:
            return TITLE_REPLY
        if tag is None or tag[0] != "swe":
            return "I do not know this task."
        task = get_task(tag[1][0])
        step = assistant_turns(text)
        key = sorted(task_ids()).index(task["task_id"])
        edits = task["wrong_fix"] if self._keys.is_wrong(key) else task["oracle_fix"]
        if aider:  # its system prompt holds example turns: whether our fix is in the history decides
            return "Done." if AIDER_FIX in text else AIDER_FIX + "\n\n" + aider_blocks(edits)
        if step == 0:
            call = shell_call(tools, _apply_edits_command(edits), "Apply the fix")
        elif step == 1:
            argv = _test_prefix(task["test_cmd"]) + [task["FAIL_TO_PASS"][0]]
            call = shell_call(tools, " ".join(shlex.quote(a) for a in argv) + " 2>&1 | tail -n 3",
                              "Run the failing test")
        else:
            return "The fix is in place and the failing test passes."
        if call is None:
            return "No shell tool is offered: I cannot fix this."
        return ("I found the bug; let me fix it.\n" if step == 0 else "Let me run the failing test.\n") + call


class HarnessOracle(Policy):
    """Every preset's oracle in one policy (one scripted backend serves every harness job): prompts
    in mini-swe-agent's text format go to :class:`MiniSWEOracle`, swe prompts of the other presets
    (their own tools, or aider's edit format) to :class:`PresetOracle`, the rest (the openai-tools
    loop's hermes tool calls) to the domain :class:`~rolloutd.handlers.oracles.Oracle`."""

    name = "harness_oracle"

    def __init__(self, **options: Any) -> None:
        from rolloutd.handlers.oracles import Oracle

        super().__init__(**options)
        self.mini = MiniSWEOracle(**options)
        self.preset = PresetOracle(**options)
        self.tools = Oracle(**options)

    def warm(self) -> None:
        self.tools.warm()

    def reply(self, request: PolicyRequest) -> str:
        text = request.prompt_text
        if "```mswea_bash_command" in text:
            return self.mini.reply(request)
        names = {t["name"] for t in offered_tools(text)}
        if "editor" in names or "python" in names:  # the domain tools (openai-tools, the built-in loop)
            return self.tools.reply(request)
        from rolloutd.handlers.tasks import find_task_tag

        tag = find_task_tag(text)
        if names or tag is None or tag[0] == "swe":  # a harness's tools, aider, a side call
            return self.preset.reply(request)
        return self.tools.reply(request)


def _block(cmd: str) -> str:
    return "```mswea_bash_command\n" + cmd + "\n```"


def _apply_edits_command(edits: list[dict]) -> str:
    """A shell command that applies ``[{path, old, new}]`` replacements with python3 (exactly once each)."""
    prog = ("import json,sys\n"
            "for e in json.loads(sys.argv[1]):\n"
            "    s = open(e['path']).read()\n"
            "    assert s.count(e['old']) == 1, e['path']\n"
            "    open(e['path'], 'w').write(s.replace(e['old'], e['new']))\n"
            "print('edited', len(json.loads(sys.argv[1])), 'file(s)')")
    payload = json.dumps([{"path": e["path"], "old": e["old"], "new": e["new"]} for e in edits])
    return "python3 -c " + shlex.quote(prog) + " " + shlex.quote(payload)


def main(argv=None) -> int:
    import argparse

    ap = argparse.ArgumentParser(prog="python -m rolloutd.handlers.harness_presets")
    sub = ap.add_subparsers(dest="cmd", required=True)
    v = sub.add_parser("venv", help="build the agent virtual environment at DIR: mini-swe-agent, openai, "
                                    "aider-chat from PyPI, the pinned npm harnesses into DIR/node")
    v.add_argument("dir")
    v.add_argument("--python", default=None, help="interpreter the venv is made from (default: /usr/bin/python3)")
    v.add_argument("--no-npm", action="store_true", help="skip the npm harnesses (no Node on this machine)")
    sub.add_parser("pins", help="print every preset's pinned package")
    ns = ap.parse_args(argv)
    if ns.cmd == "pins":
        for name, pkg in sorted({**NPM_PACKAGES, **PYPI_PACKAGES}.items()):
            print(f"{name}\t{pkg}")
        return 0
    print(build_agent_venv(ns.dir, python=ns.python, quiet=False, npm=() if ns.no_npm else None))
    return 0


if __name__ == "__main__":
    sys.exit(main())
