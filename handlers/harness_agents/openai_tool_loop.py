"""A small agent on the ``openai`` SDK: chat completions with ``bash`` and ``python`` tools until
the model answers without a tool call; the answer goes to stdout.

Runs unmodified against any OpenAI-compatible server: ``OPENAI_BASE_URL`` and ``OPENAI_API_KEY``
come from the environment (the SDK reads them). The task text comes from ``--task`` or stdin.
Exit codes: 0 answered, 3 out of turns, anything else a crash (the SDK's exception).
"""
import argparse
import os
import subprocess
import sys

from openai import OpenAI

TOOLS = [
    {"type": "function", "function": {
        "name": "bash", "description": "Run a bash command in the working directory.",
        "parameters": {"type": "object", "properties": {"command": {"type": "string"}}, "required": ["command"]}}},
    {"type": "function", "function": {
        "name": "python", "description": "Run Python code; print what you need to see.",
        "parameters": {"type": "object", "properties": {"code": {"type": "string"}}, "required": ["code"]}}},
]
SYSTEM = "You are a helpful assistant. Use the tools to compute or inspect what you need, then answer."


def run_tool(name, args, timeout):
    if name == "bash" and isinstance(args.get("command"), str):
        argv = ["bash", "-c", args["command"]]
    elif name == "python" and isinstance(args.get("code"), str):
        argv = [sys.executable, "-c", args["code"]]
    else:
        return "Error: unknown tool %r or bad arguments" % name
    try:
        p = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return "Error: the command timed out after %ss" % timeout
    out = (p.stdout + p.stderr).strip()
    if p.returncode:
        out += "\n[exit code %d]" % p.returncode
    return out or "[no output]"


def main():
    import json

    ap = argparse.ArgumentParser()
    ap.add_argument("--task", default=None)
    ap.add_argument("--model", default=os.environ.get("OPENAI_MODEL", "rolloutd"))
    ap.add_argument("--max-turns", type=int, default=10)
    ap.add_argument("--tool-timeout", type=float, default=60.0)
    ns = ap.parse_args()
    task = ns.task if ns.task is not None else sys.stdin.read()
    client = OpenAI(max_retries=0)
    messages = [{"role": "system", "content": SYSTEM}, {"role": "user", "content": task}]
    for _ in range(max(1, ns.max_turns)):
        resp = client.chat.completions.create(model=ns.model, messages=messages, tools=TOOLS)
        msg = resp.choices[0].message
        messages.append(msg.model_dump(exclude_none=True, exclude_unset=True))
        if not msg.tool_calls:
            print(msg.content or "")
            return 0
        for tc in msg.tool_calls:
            try:
                args = json.loads(tc.function.arguments or "{}")
            except ValueError:
                args = {}
            out = run_tool(tc.function.name, args if isinstance(args, dict) else {}, ns.tool_timeout)
            messages.append({"role": "tool", "tool_call_id": tc.id, "content": out})
    print("no answer after %d turns" % ns.max_turns, file=sys.stderr)
    return 3


if __name__ == "__main__":
    sys.exit(main())
