"""pytest as a grader over a workspace the agent shaped: one hardening for every domain that grades
with pytest (``swe``, harness ``eval.pytest``).

What it closes (docs/SANDBOX.md, "Round 2: graders and abstention"):

* ``argv``: ``python3 -B -c BOOT -p no:cacheprovider -o addopts= --rootdir <ws> --confcutdir <ws>
  -c <config> <args>``: the workspace is off ``sys.path`` until pytest is imported (a ``pytest.py``
  of the agent's is not the grader), no cache, no ``addopts`` from any ini file, rootdir and the
  ini file pinned (an agent's ``pytest.ini``/``tox.ini``/``setup.cfg`` is never read: ``-c`` names
  the host's choice, an empty one the host writes when there is none);
* ``env``: ``PYTEST_DISABLE_PLUGIN_AUTOLOAD=1`` (no plugin of an installed distribution loads),
  pytest from the host's read-only mount, the end token;
* ``split_at_end``: outcomes count only before our plugin's end line, which carries pytest's status;
* ``restore_paths``: paths put back from a pristine tree after the purge, directories whole (files
  the agent added there removed), never through a symlink;
* ``sweep_conftests``: every ``conftest.py`` but the host's deleted, by directory fd.

Both walks are iterative with bounded depth and entries: a tree the agent made too deep or too
large raises :class:`WorkspaceUnfit` (the agent's doing: the job is graded reward 0 with that
reason, never ``failed``), not RecursionError or EMFILE.
"""
from __future__ import annotations

import errno
import os
import shutil
import stat
from pathlib import Path

from rolloutd.handlers.base import AgentFault
from rolloutd.handlers.tasks import PYTEST_MOUNT, clean_env, pytest_link_dir

MAX_DEPTH = 128            # directory levels below the workspace a grade walks (a real repository: < 20)
MAX_ENTRIES = 500_000      # directory entries a grade walks (this repo with its venv: ~60k)
CONFIG_FILES = ("pytest.ini", ".pytest.ini", "pyproject.toml", "tox.ini", "setup.cfg")  # pytest's order
# Written by the host after the purge when the grade has no ini file of its own: `-c` must name a
# file in the rootdir (pytest resolves ini paths such as `-o pythonpath=src` against its directory).
EMPTY_CONFIG = ".rolloutd-pytest.ini"
# Errors of the host's writes into the agent's tree that only the agent's doing explains (a workspace
# it filled, a name or tree too long, a directory it made unreadable to a daemon of its own uid): the
# job is scored 0 with the reason (AgentFault). Others (EIO, EMFILE of the daemon) fail it.
AGENT_ERRNOS = frozenset({errno.ENOSPC, errno.EDQUOT, errno.EFBIG, errno.ENAMETOOLONG, errno.ELOOP, errno.EMLINK,
                          errno.EACCES, errno.EPERM, errno.ENOTEMPTY, errno.ENOTDIR, errno.EISDIR})
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC

# pytest as the grader runs it: `python3 -B -c BOOT <args>`. The boot takes the workspace (-c's '')
# off sys.path until pytest is imported (a pytest.py of the agent's is not the grader), then the
# workspace goes right after the standard library (not first, as `-m pytest` would put it). Our
# plugin runs last: after pytest's own summary it prints an end line (a per-run token from the environment, removed before any
# workspace code runs) with the session's exit status and leaves with os._exit, so nothing the
# code under test registered (atexit) prints after it. Outcomes are read only before that line.
PYTEST_BOOT = r"""
import sys
sys.path[:] = [p for p in sys.path if p not in ("", ".")]  # what -P does, for Pythons before 3.11
import os
import pytest
END = os.environ.pop("ROLLOUTD_PYTEST_END", "")


class RolloutdEnd:
    status = None

    @pytest.hookimpl(trylast=True)
    def pytest_sessionfinish(self, session, exitstatus):
        self.status = int(exitstatus)

    @pytest.hookimpl(trylast=True)
    def pytest_unconfigure(self, config):
        if self.status is None or not END:
            return
        sys.stdout.flush()
        sys.stderr.flush()
        os.write(1, ("\n%s %d\n" % (END, self.status)).encode())
        os._exit(self.status)


# The workspace goes after the standard library and pytest's own mount (before site-packages): a
# module of the agent's named like one pytest imports later (pdb, difflib, unittest, pluggy) or
# a test imports (fractions) is not what the grader runs. Its own packages import as before.
import sysconfig
STD = tuple(os.path.realpath(sysconfig.get_path(k)) for k in ("stdlib", "platstdlib"))


def _std(p):
    r = os.path.realpath(p or ".")
    return r.endswith(".zip") or any((r == s or r.startswith(s + os.sep)) and "-packages" not in r for s in STD)


sys.path.insert(max([i + 1 for i, p in enumerate(sys.path) if _std(p)] or [len(sys.path)]), os.getcwd())
sys.exit(pytest.main(sys.argv[1:], plugins=[RolloutdEnd()]))
"""


class WorkspaceUnfit(AgentFault):
    """The workspace cannot be prepared for grading because of what the agent made of it (too deep,
    too many entries): an agent-caused grade failure (reward 0 with this reason)."""


def argv(args: list[str], *, rootdir: str, config: str) -> list[str]:
    """The grader's argv: pytest with every hardening above, then ``args`` (paths, ``-k``, ...).
    ``config`` is the ini file pytest reads, relative to ``rootdir`` (``pin_config``)."""
    return (["python3", "-B", "-c", PYTEST_BOOT, "-p", "no:cacheprovider", "-o", "addopts=",
             "--rootdir", rootdir, "--confcutdir", rootdir, "-c", f"{rootdir}/{config}"] + list(args))


def pin_config(ws: str | os.PathLike, config: str | None) -> str:
    """The ini file the grade names with ``-c``: ``config`` (a path the host restored or wrote after
    the purge), else an empty one the host writes now (EMPTY_CONFIG, a fresh inode)."""
    if config:
        return check_rel(config)
    fd = os.open(ws, _DIR_FLAGS)
    try:
        remove_at(fd, EMPTY_CONFIG)
        out = os.open(EMPTY_CONFIG, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644,
                      dir_fd=fd)
        try:
            os.write(out, b"[pytest]\n")
        finally:
            os.close(out)
    finally:
        os.close(fd)
    return EMPTY_CONFIG


def env(sandbox: dict, end: str, extra: dict[str, str] | None = None) -> dict[str, str]:
    """The grader's whole environment: pytest from the host's read-only mount (a symlink directory
    on the local runtime), no plugin autoload, the end token."""
    path = pytest_link_dir() if sandbox.get("runtime") == "local" else PYTEST_MOUNT
    return clean_env(dict({"PYTHONPATH": path, "PYTEST_DISABLE_PLUGIN_AUTOLOAD": "1", "ROLLOUTD_PYTEST_END": end},
                          **(extra or {})))


def split_at_end(output: str, end: str) -> tuple[str, int | None]:
    """The output before the LAST end line of our plugin, and the status on it (None: no end
    line, or text after it: then nothing of the output counts)."""
    i = output.rfind("\n" + end + " ")
    if i < 0:
        return "", None
    line, _, rest = output[i + 1:].partition("\n")
    if rest.strip():
        return "", None
    try:
        return output[:i], int(line.split()[-1])
    except ValueError:
        return "", None


def config_of(root: str | os.PathLike) -> str | None:
    """The ini file pytest would read at ``root`` (relative path), by pytest's own order and
    markers; None without one."""
    markers = {"pyproject.toml": ("[tool.pytest.ini_options]", "[tool.pytest]"), "tox.ini": ("[pytest]",),
               "setup.cfg": ("[tool:pytest]",)}
    for name in CONFIG_FILES:
        p = Path(root) / name
        if not p.is_file() or p.is_symlink():
            continue
        if name not in markers:
            return name
        text = p.read_text(encoding="utf-8", errors="replace")
        if any(m in text for m in markers[name]):
            return name
    return None


# -- bounded walks ---------------------------------------------------------------------------------
class _Budget:
    def __init__(self, max_depth: int, max_entries: int):
        self.max_depth, self.max_entries, self.seen = max_depth, max_entries, 0

    def entry(self):
        self.seen += 1
        if self.seen > self.max_entries:
            raise WorkspaceUnfit(f"the workspace holds more than {self.max_entries} entries")

    def depth(self, d: int):
        if d > self.max_depth:
            raise WorkspaceUnfit(f"the workspace is more than {self.max_depth} directories deep")


def _listdir(fd: int, budget: _Budget) -> tuple[list[str], list[str]]:
    """(sub-directories, other entries) of an open directory; symlinks are never directories."""
    dirs, others = [], []
    with os.scandir(fd) as it:
        for e in it:
            budget.entry()
            (dirs if e.is_dir(follow_symlinks=False) else others).append(e.name)
    return dirs, others


def walk(root: str | os.PathLike, *, skip_top: tuple[str, ...] = (), max_depth: int = MAX_DEPTH,
         max_entries: int = MAX_ENTRIES):
    """Every directory under ``root`` as ``(rel, dir_fd, dirs, others)``, depth first, no symlink
    followed, without recursion: one open fd per level. The caller may prune ``dirs`` (as with
    os.walk). Raises WorkspaceUnfit past the bounds."""
    budget = _Budget(max_depth, max_entries)
    top = os.open(root, _DIR_FLAGS)
    stack = []  # (fd, rel, iterator over the sub-directories left)
    try:
        dirs, others = _listdir(top, budget)
        dirs = [d for d in dirs if d not in skip_top]
        stack.append((top, "", None))
        yield "", top, dirs, others
        stack[-1] = (top, "", iter(list(dirs)))
        while stack:
            fd, rel, subs = stack[-1]
            name = next(subs, None)
            if name is None:
                os.close(stack.pop()[0])
                continue
            budget.depth(len(stack))
            try:
                child = os.open(name, _DIR_FLAGS, dir_fd=fd)
            except OSError as e:
                if e.errno in (errno.ENOENT, errno.ELOOP, errno.ENOTDIR):
                    continue  # removed by the caller, or not a directory any more
                raise
            crel = f"{rel}/{name}" if rel else name
            stack.append((child, crel, None))
            dirs, others = _listdir(child, budget)
            yield crel, child, dirs, others
            stack[-1] = (child, crel, iter(list(dirs)))
    finally:
        for fd, _, _ in stack:
            os.close(fd)


def remove_at(dir_fd: int, name: str, *, max_depth: int = MAX_DEPTH, max_entries: int = MAX_ENTRIES) -> None:
    """Remove the entry ``name`` of an open directory whatever it is (a file, a symlink, a FIFO, a
    directory tree: emptied bottom-up by fd, without recursion). Missing is fine."""
    try:
        st = os.stat(name, dir_fd=dir_fd, follow_symlinks=False)
    except FileNotFoundError:
        return
    if not stat.S_ISDIR(st.st_mode):
        os.unlink(name, dir_fd=dir_fd)
        return
    budget = _Budget(max_depth, max_entries)
    stack = []  # (parent fd, name, own fd, sub-directories left)
    try:
        fd = os.open(name, _DIR_FLAGS, dir_fd=dir_fd)
        stack.append((dir_fd, name, fd, None))
        while stack:
            parent, nm, fd, subs = stack[-1]
            if subs is None:
                subs, others = _listdir(fd, budget)
                for o in others:
                    os.unlink(o, dir_fd=fd)
                stack[-1] = (parent, nm, fd, subs)
            if subs:
                budget.depth(len(stack))
                sub = subs.pop()
                stack.append((fd, sub, os.open(sub, _DIR_FLAGS, dir_fd=fd), None))
                continue
            os.close(fd)
            stack.pop()
            os.rmdir(nm, dir_fd=parent)
    finally:
        for _, _, fd, _ in stack:
            os.close(fd)


def remove(path: str | os.PathLike) -> None:
    """``remove_at`` by path (its parent must be a real directory: restore makes sure)."""
    p = Path(path)
    fd = os.open(p.parent, _DIR_FLAGS)
    try:
        remove_at(fd, p.name)
    finally:
        os.close(fd)


# -- restore and sweep -----------------------------------------------------------------------------
def check_rel(rel: str) -> str:
    """A workspace-relative path (no absolute path, no '..', not the root itself), normalised."""
    parts = [p for p in Path(rel).parts if p not in ("", ".")] if isinstance(rel, str) and "\0" not in rel else []
    if not parts or rel.startswith("/") or ".." in parts or any(len(p.encode("utf-8", "surrogateescape")) > 255
                                                                for p in parts):
        raise ValueError(f"{rel!r} is not a path inside the workspace")
    return "/".join(parts)


def restore_paths(src_root: str | os.PathLike, dst_root: str | os.PathLike, rels: list[str]) -> list[str]:
    """Make each ``dst_root/rel`` a fresh copy of ``src_root/rel``: a file, or a directory whole
    (every file of the pristine one, ``__init__.py`` included; whatever the agent added there
    removed). The tree is the agent's: every symlink or non-directory on the way is removed first,
    whatever stood at the path (a symlink to a host file, a FIFO, a hard link, a directory, a
    1,000-deep tree) is removed without recursion, and the copy is a fresh inode. Call it when no
    agent process is alive (after a grade's purge), or one could put a symlink back. A path missing
    from ``src_root`` is removed from ``dst_root``. Returns the paths."""
    src_root, dst_root = Path(src_root), Path(dst_root)
    rels = [check_rel(r) for r in rels]
    for rel in rels:
        dst = dst_root
        for part in Path(rel).parts[:-1]:
            dst = dst / part
            if dst.is_symlink() or (os.path.lexists(dst) and not dst.is_dir()):
                dst.unlink()  # a symlink or a file where a directory of the path should be
            dst.mkdir(exist_ok=True)
        target, src = dst_root / rel, src_root / rel
        remove(target)
        if src.is_symlink():
            os.symlink(os.readlink(src), target)
        elif src.is_dir():
            shutil.copytree(src, target, symlinks=True)
        elif src.exists():
            shutil.copy2(src, target)
    return rels


def sweep_conftests(ws: str | os.PathLike, keep: set[str]) -> list[str]:
    """Delete every ``conftest.py`` (of any type) under ``ws`` but those in ``keep`` (relative
    paths), by directory fd, never following a symlink, skipping the top ``.git``; bounded
    (WorkspaceUnfit past MAX_DEPTH / MAX_ENTRIES). Returns what was deleted."""
    gone = []
    for rel, fd, dirs, others in walk(ws, skip_top=(".git",)):
        if "conftest.py" not in dirs and "conftest.py" not in others:
            continue
        path = f"{rel}/conftest.py" if rel else "conftest.py"
        st = os.stat("conftest.py", dir_fd=fd, follow_symlinks=False)
        if stat.S_ISREG(st.st_mode) and path in keep:
            continue
        remove_at(fd, "conftest.py")
        gone.append(path)
        if "conftest.py" in dirs:
            dirs.remove("conftest.py")
    return gone
