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
import shlex
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path
from typing import Any

from rolloutd.llm.policies import Policy, PolicyRequest

AGENT_DIR = "/opt/rolloutd-agents"
_SCRIPTS = Path(__file__).resolve().parent / "harness_agents"
AGENT_PACKAGES = ("mini-swe-agent", "openai")
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


# -- the agent venv --------------------------------------------------------------------------------
def system_python() -> str:
    """The interpreter a bwrap sandbox sees: the host's /usr/bin/python3 (/usr is mounted)."""
    for p in ("/usr/bin/python3", "/usr/local/bin/python3"):
        if os.access(p, os.X_OK):
            return p
    raise RuntimeError("no system python3 under /usr: the sandbox could not run the agent venv")


def venv_ready(path: str | os.PathLike, packages=AGENT_PACKAGES) -> bool:
    marker = Path(path) / ".rolloutd-agent-venv"
    return marker.is_file() and json.loads(marker.read_text()).get("packages") == list(packages)


def build_agent_venv(path: str | os.PathLike, packages=AGENT_PACKAGES, python: str | None = None,
                     quiet: bool = True) -> str:
    """Make (or reuse) a venv at ``path`` with ``packages`` from PyPI; world-readable (its parent
    directories must be searchable by the sandbox's uid: not under /root). Returns the path."""
    path = Path(path).resolve()
    if venv_ready(path, packages):
        return str(path)
    python = python or system_python()
    subprocess.run([python, "-m", "venv", "--clear", str(path)], check=True)
    pip = [str(path / "bin" / "python"), "-m", "pip", "install", "--disable-pip-version-check"]
    if quiet:
        pip.append("-q")
    subprocess.run(pip + list(packages), check=True)
    from rolloutd.sandbox.runtime import make_world_readable

    make_world_readable(path)  # the sandbox binds it read-only and may run as nobody
    (path / ".rolloutd-agent-venv").write_text(json.dumps({"packages": list(packages)}))
    return str(path)


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


class HarnessOracle(Policy):
    """Both presets' oracle in one policy (one scripted backend serves every harness job): prompts
    in mini-swe-agent's text format go to :class:`MiniSWEOracle`, the rest (the openai-tools loop's
    hermes tool calls) to the domain :class:`~rolloutd.handlers.oracles.Oracle`."""

    name = "harness_oracle"

    def __init__(self, **options: Any) -> None:
        from rolloutd.handlers.oracles import Oracle

        super().__init__(**options)
        self.mini = MiniSWEOracle(**options)
        self.tools = Oracle(**options)

    def warm(self) -> None:
        self.tools.warm()

    def reply(self, request: PolicyRequest) -> str:
        if "```mswea_bash_command" in request.prompt_text:
            return self.mini.reply(request)
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
    v = sub.add_parser("venv", help="build the agent virtual environment (mini-swe-agent, openai) at DIR")
    v.add_argument("dir")
    v.add_argument("--python", default=None, help="interpreter the venv is made from (default: /usr/bin/python3)")
    ns = ap.parse_args(argv)
    print(build_agent_venv(ns.dir, python=ns.python, quiet=False))
    return 0


if __name__ == "__main__":
    sys.exit(main())
