"""docs/HANDLERS.md's worked example runs as written (in one process, real sandbox)."""
from __future__ import annotations

import os
import re
from pathlib import Path

DOC = Path(__file__).resolve().parents[2] / "docs" / "HANDLERS.md"


def test_the_worked_example_runs(tok_dir, need_bwrap, isolated_layout):
    blocks = re.findall(r"```python\n(# example: linecount.*?)```", DOC.read_text(), re.DOTALL)
    assert len(blocks) == 2
    code = "\n".join(blocks).replace('TOKENIZER = "/path/to/tokenizer"', f"TOKENIZER = {tok_dir!r}")
    root = os.environ["ROLLOUTD_SANDBOX_ROOT"]  # this test's own (isolated_layout), removed after it
    ns: dict = {"__name__": "linecount_example"}
    exec(compile(code, str(DOC), "exec"), ns)  # asserts reward 1 itself
    assert not list(Path(root, "sb").iterdir())  # run_local destroyed the sandbox
