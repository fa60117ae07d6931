"""docs/HANDLERS.md's worked example runs as written (in one process, real sandbox)."""
from __future__ import annotations

import os
import re
import tempfile
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "HANDLERS.md"


def test_the_worked_example_runs(tok_dir, need_bwrap, monkeypatch):
    blocks = re.findall(r"```python\n(# example: linecount.*?)```", DOC.read_text(), re.DOTALL)
    assert len(blocks) == 2
    code = "\n".join(blocks).replace('TOKENIZER = "/path/to/tokenizer"', f"TOKENIZER = {tok_dir!r}")
    root = tempfile.mkdtemp(prefix="rd-doc-", dir="/tmp")
    os.chmod(root, 0o711)
    monkeypatch.setenv("ROLLOUTD_SANDBOX_ROOT", root)  # private: other instances' janitors reap the default
    ns: dict = {"__name__": "linecount_example"}
    exec(compile(code, str(DOC), "exec"), ns)  # asserts reward 1 itself
    assert not list(Path(root, "sb").iterdir())  # run_local destroyed the sandbox
