"""The parts the harness presets stand on, each on its own (quick): Node's memory under the
sandbox's limits (issue 25 item 4), launch.py's home, the preset instances, and PresetOracle
reading each harness's shell tool from the rendered prompt."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutd.handlers.harness import HarnessInstanceError, validate
from rolloutd.handlers.harness_presets import (
    HOME,
    NPM_PACKAGES,
    PRESETS,
    PresetOracle,
    offered_tools,
    shell_tool,
)
from rolloutd.sandbox import Limits, SandboxSpec

LAUNCH = Path(__file__).resolve().parents[2] / "handlers" / "harness_agents" / "launch.py"

# Node 20's fetch instantiates llhttp as WebAssembly, whose guard regions reserve ~10 GiB of
# address space: under a 4 GiB RLIMIT_AS it fails ("WebAssembly.instantiate(): Out of memory"),
# which SDKs report as a connection error. A refused connection is the healthy answer here.
NODE_FETCH = ("fetch('http://127.0.0.1:12345/').then(() => console.log('FETCH-OK'), "
              "e => console.log('FETCH-ERR', String(e), String(e && e.cause), e && e.cause && e.cause.code))")


def _node_in_sandbox(sandboxes, limits: Limits) -> str:
    h = sandboxes.create("node", SandboxSpec(limits=limits))
    c = sandboxes.client(h, timeout=120)
    r = c.call("agent", {"argv": ["node", "-e", NODE_FETCH], "timeout": 90})
    assert r.error is None, r.error
    return r.output


@pytest.mark.skipif(shutil.which("node") is None, reason="node is not installed")
def test_node_fetch_needs_address_space_beyond_the_resident_bound(sandboxes):
    # The old harness limits (memory_mb=4096 as RLIMIT_AS): Node cannot even make a request.
    out = _node_in_sandbox(sandboxes, Limits(memory_mb=4096))
    assert "FETCH-OK" not in out and ("Out of memory" in out or "RangeError" in out), out
    # The Node presets' limits: 4096 MB resident (a cgroup where delegated), 64 GiB address space.
    out = _node_in_sandbox(sandboxes, Limits(memory_mb=4096, address_space_mb=65536))
    assert "FETCH-ERR" in out and "ECONNREFUSED" in out, out


def test_address_space_mb_replaces_memory_mb_rlimit():
    import resource

    from rolloutd.sandbox.toolserver.procs import apply_limits

    def rlimit_as_of(limits):
        p = subprocess.Popen([sys.executable, "-c", "import sys; sys.stdin.read()"], stdin=subprocess.PIPE)
        try:
            assert apply_limits(p.pid, limits) == []
            return resource.prlimit(p.pid, resource.RLIMIT_AS)[0]
        finally:
            p.communicate(b"")

    assert rlimit_as_of({"memory_mb": 512}) == 512 << 20
    assert rlimit_as_of({"memory_mb": 512, "address_space_mb": 65536}) == 65536 << 20
    assert Limits.from_dict({"memory_mb": 64, "address_space_mb": 128}).address_space_mb == 128


def test_launch_writes_the_home_then_execs(tmp_path):
    home = tmp_path / "h" / "home"
    env = dict(os.environ, HOME=str(home), XDG_CONFIG_HOME=str(home / ".config"),
               ROLLOUTD_HOME_FILES=json.dumps({".qwen/settings.json": '{"a": 1}', "x.txt": "hi"}))
    r = subprocess.run([sys.executable, "-I", str(LAUNCH), "--", "sh", "-c",
                        'cat "$HOME/.qwen/settings.json" "$HOME/x.txt"; echo "[${ROLLOUTD_HOME_FILES-unset}]"'],
                       env=env, capture_output=True, text=True, timeout=30)
    assert r.returncode == 0, r.stderr
    assert r.stdout == '{"a": 1}hi[unset]\n'  # the agent never sees the variable
    assert (home / ".config").is_dir() and oct((home / "x.txt").stat().st_mode & 0o777) == "0o600"
    env["ROLLOUTD_HOME_FILES"] = json.dumps({"../escape": "x"})
    r = subprocess.run([sys.executable, "-I", str(LAUNCH), "--", "true"], env=env, capture_output=True, text=True,
                       timeout=30)
    assert r.returncode == 2 and "outside HOME" in r.stderr and not (home.parent / "escape").exists()


def test_preset_instances_and_memory_configuration():
    swe = {"domain": "swe", "instance": {"task_id": "t"}}
    for name in NPM_PACKAGES:
        h = validate({"preset": name, "setup": swe}, {})
        assert h["env"]["HOME"] == HOME and h["home_files"], name
        assert h["limits"]["memory_mb"] == 4096 and h["limits"]["address_space_mb"] == 65536
    # the handler's config over the preset's, the instance over both
    h = validate({"preset": "pi", "setup": swe}, {"address_space_mb": 32768})
    assert h["limits"]["address_space_mb"] == 32768
    h = validate({"preset": "pi", "setup": swe, "limits": {"memory_mb": 2048}}, {"memory_mb": 3000})
    assert h["limits"]["memory_mb"] == 2048
    with pytest.raises(HarnessInstanceError, match="HOME"):
        validate({"command": ["a", "{task}"], "task": "x", "eval": {"command": ["true"]},
                  "home_files": {"a.json": "{}"}}, {})
    with pytest.raises(HarnessInstanceError, match="home_files"):
        validate({"preset": "pi", "setup": swe, "home_files": {"../x": ""}}, {})
    assert set(PRESETS) >= {"mini-swe-agent", "openai-tools", "claude-code", "codex", "gemini-cli", "qwen-code",
                            "opencode", "pi", "aider"}


# -- PresetOracle: each harness's own shell tool, as the template renders it ----------------------
HARNESS_TOOLS = {
    "qwen-code": {"name": "run_shell_command", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}, "description": {"type": "string"}, "is_background": {"type": "boolean"}},
        "required": ["command", "is_background"]}},
    "opencode": {"name": "bash", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}, "timeout": {"type": "number"}, "description": {"type": "string"}},
        "required": ["command", "description"]}},
    "codex": {"name": "exec_command", "parameters": {"type": "object", "properties": {
        "cmd": {"type": "string"}, "yield_time_ms": {"type": "number"}}, "required": ["cmd"]}},
    "codex-shell": {"name": "shell", "parameters": {"type": "object", "properties": {
        "command": {"type": "array", "items": {"type": "string"}}}, "required": ["command"]}},
    "claude-code": {"name": "Bash", "parameters": {"type": "object", "properties": {
        "command": {"type": "string"}, "timeout": {"type": "number"}}, "required": ["command"]}},
}
DECOYS = [{"name": "read_file", "parameters": {"type": "object", "properties": {"path": {"type": "string"}}}},
          {"name": "grep", "parameters": {"type": "object", "properties": {"pattern": {"type": "string"}}}}]


@pytest.mark.parametrize("harness", list(HARNESS_TOOLS))
def test_preset_oracle_answers_with_the_offered_shell_tool(harness, tiny_tokenizer):
    from rolloutd.handlers.swe_tasks import task_ids
    from rolloutd.backends.policies import PolicyRequest

    tool = HARNESS_TOOLS[harness]
    tools = [{"type": "function", "function": dict(t, description="d")} for t in DECOYS + [tool]]
    tid = sorted(task_ids())[0]
    msgs = [{"role": "system", "content": "You are a coding agent."},
            {"role": "user", "content": f"[task swe:{tid}] Fix the bug."}]
    text = tiny_tokenizer.apply_chat_template(msgs, tools=tools, add_generation_prompt=True, tokenize=False)
    assert [t["name"] for t in offered_tools(text)] == [t["name"] for t in DECOYS + [tool]]
    assert shell_tool(offered_tools(text))[0] == tool["name"]
    ids = tiny_tokenizer.encode(text, add_special_tokens=False)
    req = PolicyRequest(prompt_ids=ids, api="vllm", max_tokens=4096, decode=tiny_tokenizer.decode)
    reply = PresetOracle(wrong_every=0).reply(req)
    call = json.loads(reply.split("<tool_call>\n", 1)[1].split("\n</tool_call>")[0])
    assert call["name"] == tool["name"]
    props, required = tool["parameters"]["properties"], tool["parameters"]["required"]
    assert set(required) <= set(call["arguments"])
    cmd = call["arguments"]["cmd" if "cmd" in props else "command"]
    cmd = cmd[-1] if isinstance(cmd, list) else cmd
    assert cmd.startswith("python3 -c ")  # the fix, applied by the harness's own shell
    # a title-style side call (no tools) gets a short text, no call
    side = tiny_tokenizer.apply_chat_template(msgs, add_generation_prompt=True, tokenize=False)
    req = PolicyRequest(prompt_ids=tiny_tokenizer.encode(side, add_special_tokens=False), api="vllm",
                        max_tokens=64, decode=tiny_tokenizer.decode)
    assert "<tool_call>" not in PresetOracle(wrong_every=0).reply(req)
