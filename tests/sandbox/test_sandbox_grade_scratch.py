"""The grader's scratch (issue 35 item 6): its HOME and TMPDIR are on a mount of their own, so an
agent that fills /tmp, bytes and inodes, cannot turn a grade into a failed job (3 M empty files
in /tmp made `grade` fail with ENOSPC). The agent can write the scratch too (same uid): grade
empties it after the purge, whatever the agent left there (a 3,000-deep tree, unreadable dirs,
a symlink to /workspace that must not be followed, every inode taken)."""
from __future__ import annotations

import asyncio
import os

from rolloutd.bus.messages import Job
from rolloutd.handlers.base import JobContext, Services
from rolloutd.sandbox import SandboxSpec

RIGHT = ("def has_close_elements(numbers, threshold):\n"
         "    return any(abs(a - b) < threshold for i, a in enumerate(numbers) for b in numbers[i + 1:])\n")

FILL = r'''
import errno, os
out = {}

def fill_bytes(path):
    try:
        with open(path, "wb") as f:
            while True:
                f.write(b"x" * (1 << 20))
                f.flush()
    except OSError as e:
        return errno.errorcode[e.errno]

def fill_inodes(d, limit):
    n = 0
    try:
        while n < limit:
            open("%s/e%d" % (d, n), "w").close()
            n += 1
    except OSError as e:
        return n, errno.errorcode[e.errno]
    return n, None

out["tmp_bytes"] = fill_bytes("/tmp/big")
out["tmp_inodes"] = fill_inodes("/tmp", 6000)  # /tmp of 16 MB: 4096 inodes as root
g = "/run/rolloutd-grade"
if os.path.isdir(g):
    os.symlink("/workspace", g + "/ws")  # emptying must not follow it
    os.chdir(g)
    for _ in range(3000):  # deeper than Python's recursion limit, longer than PATH_MAX
        os.mkdir("a")
        os.chdir("a")
    os.chdir(g)
    os.mkdir("locked")
    open("locked/x", "w").close()
    os.chmod("locked", 0)
    os.chmod("a", 0)
    out["scratch_bytes"] = fill_bytes(g + "/big")
    out["scratch_inodes"] = fill_inodes(g, 20000)
print(repr(out))
'''

# A grader that needs its scratch: a temp file of 1 MiB and a file in HOME.
GRADER = ("import os, tempfile\n"
          "with tempfile.TemporaryFile() as f:\n"
          "    f.write(b'y' * (1 << 20)); f.flush()\n"
          "open(os.path.join(os.environ['HOME'], 'note'), 'w').write('x')\n"
          "print('grader ok', os.environ['TMPDIR'] == os.environ['HOME'], len(os.listdir(os.path.dirname(os.environ['HOME']))))\n")


def test_an_agent_that_fills_tmp_and_the_scratch_cannot_stop_grading(short_root):
    from rolloutd.handlers.code import CodeHandler
    from tests.conftest import require_bwrap
    from tests.sandbox.conftest import Tracker, _make

    require_bwrap()
    t = Tracker(_make("bwrap", short_root, tmp_size_mb=16))
    try:
        h = t.create("fill", SandboxSpec(workspace_files={"solution.py": RIGHT, "fill.py": FILL}))
        c = t.client(h, timeout=120)
        r = c.call("bash", {"command": "python3 fill.py", "timeout": 100})
        assert r.exit_code == 0, r
        filled = eval(r.output.strip().splitlines()[-1])
        assert filled["tmp_bytes"] == "ENOSPC", filled  # the control: /tmp is full
        g = c.call("grade", {"argv": ["python3", "-c", GRADER], "timeout": 60})
        assert g.error is None and g.exit_code == 0, g
        # its own TMPDIR, and nothing of the agent's left beside its HOME
        assert g.output.strip().splitlines()[-1] == "grader ok True 1", g
        if t.rt.disk_quota != "measured":  # the controls: /tmp has an inode bound as root (bwrap's alone has millions)
            assert filled["tmp_inodes"][1] == "ENOSPC", filled
            assert filled["scratch_bytes"] == "ENOSPC" and filled["scratch_inodes"][1] == "ENOSPC", filled
        assert (os.path.exists(os.path.join(h.workspace, "solution.py"))), "emptying followed the agent's symlink"
        ctx = JobContext(Job(job_id=1, attempt=1, handler="test", instance={}, sandbox=h.to_dict()),
                         Services(lambda: t.rt))
        ctx.state.update(task_id="HumanEval/0")
        ctx.phase = "eval"
        reward, details = asyncio.run(CodeHandler().evaluate(ctx))
        assert reward == 1.0, details  # a correct solution is graded correct, not a failed job
    finally:
        t.cleanup()
