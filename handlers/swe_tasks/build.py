"""Build the buggy repositories of the ``swe`` tasks from pinned PyPI sdists, cached.

For each task: fetch the pinned sdist with ``pip download --no-binary :all: --no-deps``
(checked against its sha256), unpack it, apply OUR bug patch (pure-Python applier, exact
match), optionally ``git init`` + commit the buggy state, and keep the result in the cache:

    <cache>/sdists/<name>-<version>.tar.gz
    <cache>/repos/<task_id>/            the buggy repository
    <cache>/repos/<task_id>.stamp       JSON: build hash of the task definition, time

Idempotent: a task whose stamp carries the current build hash is not rebuilt. Concurrent
builders (threads or processes, also across checkouts sharing a cache) are serialized by an
fcntl lock on ``<cache>/.lock``; a repository is built in a temporary directory and renamed
into place, so readers never see a half-built tree.

Cache dir: argument > env ROLLOUTD_SWE_CACHE > $XDG_CACHE_HOME/rolloutd/swe_tasks
(default ~/.cache/rolloutd/swe_tasks). Env ROLLOUTD_SWE_SDISTS may name a directory of
already-downloaded sdists (an offline mirror) that is looked in before the network.

CLI: ``python -m rolloutd.handlers.swe_tasks [--cache DIR] [--task ID ...] [--verify]``.
"""
from __future__ import annotations

import concurrent.futures
import contextlib
import errno
import fcntl
import hashlib
import json
import os
import shutil
import subprocess
import sys
import tarfile
import tempfile
import time
import zipfile
from pathlib import Path
from typing import Iterable, Iterator

import structlog

from rolloutd.handlers.swe_tasks.patching import PatchError, apply_unified_diff
from rolloutd.handlers.swe_tasks.taskdefs import build_hash, get_task, load_tasks, read_patch

log = structlog.get_logger("rolloutd.swe_tasks")

ENV_CACHE = "ROLLOUTD_SWE_CACHE"
ENV_SDISTS = "ROLLOUTD_SWE_SDISTS"
PIP_TIMEOUT_S = 300.0
LOCK_TIMEOUT_S = 900.0
GIT_TIMEOUT_S = 60.0


class BuildError(RuntimeError):
    """A task repository could not be built (bad patch, bad archive, ...)."""


class DownloadError(BuildError):
    """The pinned sdists could not be fetched (no network, index down, hash mismatch)."""


# ----------------------------------------------------------------------------- cache dir
def default_cache_dir() -> Path:
    env = os.environ.get(ENV_CACHE)
    if env:
        return Path(env).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "rolloutd" / "swe_tasks"


def resolve_cache_dir(cache_dir: str | os.PathLike | None = None) -> Path:
    path = Path(cache_dir).expanduser() if cache_dir is not None else default_cache_dir()
    path.mkdir(parents=True, exist_ok=True)
    return path.resolve()


@contextlib.contextmanager
def cache_lock(cache: Path, timeout_s: float = LOCK_TIMEOUT_S) -> Iterator[None]:
    """Exclusive fcntl lock on ``<cache>/.lock`` (per open file, so it also serializes threads)."""
    fd = os.open(cache / ".lock", os.O_RDWR | os.O_CREAT, 0o644)
    try:
        deadline = time.monotonic() + timeout_s
        waited = False
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except OSError as exc:
                if exc.errno not in (errno.EAGAIN, errno.EACCES):
                    raise
                if not waited:
                    log.info("build_lock_wait", cache=str(cache))
                    waited = True
                if time.monotonic() > deadline:
                    raise BuildError(f"timed out after {timeout_s:.0f}s waiting for {cache / '.lock'}") from None
                time.sleep(0.1)
        yield
    finally:
        os.close(fd)  # closing the descriptor releases the lock


# ----------------------------------------------------------------------------- sdists
def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        for chunk in iter(lambda: fh.read(1 << 20), b""):
            h.update(chunk)
    return h.hexdigest()


def _pip_argv() -> list[str]:
    try:
        import pip  # noqa: F401  (only to know whether `-m pip` works here)
        return [sys.executable, "-m", "pip"]
    except ImportError:
        exe = shutil.which("pip3") or shutil.which("pip")
        if not exe:
            raise DownloadError("pip is not available (neither `python -m pip` nor pip3 on PATH)") from None
        return [exe]


def _pip_download(specs: list[str], dest: Path) -> None:
    argv = _pip_argv() + ["download", "--no-binary", ":all:", "--no-deps", "--disable-pip-version-check",
                          "--no-input", "--timeout", "30", "--retries", "2", "-d", str(dest), *specs]
    env = dict(os.environ, PIP_DISABLE_PIP_VERSION_CHECK="1", PIP_NO_INPUT="1")
    try:
        proc = subprocess.run(argv, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, env=env,
                              stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired as exc:
        raise DownloadError(f"pip download {' '.join(specs)} timed out after {PIP_TIMEOUT_S:.0f}s") from exc
    if proc.returncode != 0:
        tail = "\n".join((proc.stderr or proc.stdout).strip().splitlines()[-8:])
        raise DownloadError(f"pip download {' '.join(specs)} failed (exit {proc.returncode}):\n{tail}")


def _sdist_path(cache: Path, task: dict) -> Path:
    return cache / "sdists" / task["sdist"]


def _sdist_ok(path: Path, task: dict) -> bool:
    return path.is_file() and _sha256(path) == task["sdist_sha256"]


def ensure_sdists(tasks: Iterable[dict], cache: Path, *, parallel: int = 3) -> dict[str, Path]:
    """Make sure every task's pinned sdist is in ``<cache>/sdists`` with the right sha256.
    Call with the cache lock held. Returns {sdist file name: path}."""
    sdir = cache / "sdists"
    sdir.mkdir(parents=True, exist_ok=True)
    wanted: dict[str, dict] = {}
    for t in tasks:
        wanted.setdefault(t["sdist"], t)
    missing = {}
    for name, t in wanted.items():
        path = sdir / name
        if _sdist_ok(path, t):
            continue
        mirror = os.environ.get(ENV_SDISTS)
        if mirror and _sdist_ok(Path(mirror) / name, t):
            shutil.copy2(Path(mirror) / name, path)
            log.info("sdist_from_mirror", sdist=name, mirror=mirror)
            continue
        missing[name] = t
    if missing:
        t0 = time.monotonic()
        with tempfile.TemporaryDirectory(prefix=".dl-", dir=sdir) as tmp:
            specs = [f"{t['library']}=={t['version']}" for t in missing.values()]
            groups = [specs[i::parallel] for i in range(min(parallel, len(specs)))]
            with concurrent.futures.ThreadPoolExecutor(len(groups)) as pool:
                futures = [pool.submit(_pip_download, g, Path(tmp)) for g in groups]
                errors = [f.exception() for f in futures if f.exception() is not None]
            if errors:
                raise errors[0]
            for name, t in missing.items():
                got = Path(tmp) / name
                if not got.is_file():
                    present = sorted(p.name for p in Path(tmp).iterdir())
                    raise DownloadError(f"pip did not produce {name} for {t['library']}=={t['version']} "
                                        f"(got {present})")
                digest = _sha256(got)
                if digest != t["sdist_sha256"]:
                    raise DownloadError(f"{name}: sha256 {digest} does not match the pinned "
                                        f"{t['sdist_sha256']}")
                os.replace(got, sdir / name)
                log.info("sdist_downloaded", sdist=name, bytes=(sdir / name).stat().st_size)
        log.info("sdists_ready", downloaded=len(missing), seconds=round(time.monotonic() - t0, 2))
    return {name: sdir / name for name in wanted}


def _safe_members_tar(tf: tarfile.TarFile, dest: Path) -> list[tarfile.TarInfo]:
    dest = dest.resolve()
    members = []
    for m in tf.getmembers():
        target = (dest / m.name).resolve()
        if not str(target).startswith(str(dest) + os.sep) and target != dest:
            raise BuildError(f"archive member escapes the destination: {m.name!r}")
        if m.issym() or m.islnk() or m.isdev():
            continue  # sdists of our libraries have none; refuse to create them
        members.append(m)
    return members


def unpack_sdist(archive: Path, dest: Path) -> None:
    """Unpack an sdist (.tar.gz/.tar.bz2/.zip) into ``dest`` safely."""
    dest.mkdir(parents=True, exist_ok=True)
    if archive.name.endswith(".zip"):
        with zipfile.ZipFile(archive) as zf:
            for name in zf.namelist():
                target = (dest / name).resolve()
                if not str(target).startswith(str(dest.resolve()) + os.sep):
                    raise BuildError(f"archive member escapes the destination: {name!r}")
            zf.extractall(dest)
        return
    with tarfile.open(archive) as tf:
        members = _safe_members_tar(tf, dest)
        if hasattr(tarfile, "data_filter"):
            tf.extractall(dest, members=members, filter="data")
        else:  # pragma: no cover - Python without PEP 706
            tf.extractall(dest, members=members)


def pristine_tree(task: dict, dest: Path, cache_dir: str | os.PathLike | None = None) -> Path:
    """Unpack the task's sdist WITHOUT the bug patch into ``dest``; returns the repo dir.
    (For checks and authoring: the oracle fix must turn the buggy tree back into this.)"""
    cache = resolve_cache_dir(cache_dir)
    with cache_lock(cache):
        sdist = ensure_sdists([task], cache)[task["sdist"]]
    unpack_sdist(sdist, dest)
    repo = dest / task["sdist_subdir"]
    if not repo.is_dir():
        raise BuildError(f"{task['task_id']}: {sdist.name} has no top directory {task['sdist_subdir']!r}")
    return repo


# ----------------------------------------------------------------------------- repos
def _stamp_path(cache: Path, task_id: str) -> Path:
    return cache / "repos" / f"{task_id}.stamp"


def repo_path(task_id: str, cache_dir: str | os.PathLike | None = None) -> Path:
    return resolve_cache_dir(cache_dir) / "repos" / task_id


def _is_current(cache: Path, task: dict, digest: str) -> bool:
    stamp = _stamp_path(cache, task["task_id"])
    repo = cache / "repos" / task["task_id"]
    try:
        data = json.loads(stamp.read_text())
    except (OSError, ValueError):
        return False
    return data.get("build_hash") == digest and repo.is_dir()


def _git_init(repo: Path, task: dict) -> bool:
    git = shutil.which("git")
    if not git:
        return False
    env = dict(os.environ, GIT_AUTHOR_NAME="rolloutd", GIT_AUTHOR_EMAIL="swe-tasks@rolloutd.invalid",
               GIT_COMMITTER_NAME="rolloutd", GIT_COMMITTER_EMAIL="swe-tasks@rolloutd.invalid",
               GIT_AUTHOR_DATE="2000-01-01T00:00:00Z", GIT_COMMITTER_DATE="2000-01-01T00:00:00Z",
               GIT_CONFIG_NOSYSTEM="1", GIT_CONFIG_GLOBAL=os.devnull)
    steps = [["init", "-q"], ["add", "-A", "-f"],
             ["-c", "commit.gpgsign=false", "commit", "-q", "--no-verify", "-m",
              f"{task['library']} {task['version']} ({task['task_id']})"]]
    for step in steps:
        try:
            proc = subprocess.run([git, *step], cwd=repo, env=env, capture_output=True, text=True,
                                  timeout=GIT_TIMEOUT_S, stdin=subprocess.DEVNULL)
        except (OSError, subprocess.TimeoutExpired) as exc:
            log.warning("git_init_failed", task_id=task["task_id"], error=str(exc))
            shutil.rmtree(repo / ".git", ignore_errors=True)
            return False
        if proc.returncode != 0:
            log.warning("git_init_failed", task_id=task["task_id"], step=step[0], stderr=proc.stderr.strip())
            shutil.rmtree(repo / ".git", ignore_errors=True)
            return False
    return True


def _build_locked(task: dict, cache: Path, *, git: bool, force: bool) -> Path:
    tid = task["task_id"]
    digest = build_hash(task)
    repo = cache / "repos" / tid
    if not force and _is_current(cache, task, digest):
        log.debug("task_cached", task_id=tid, path=str(repo))
        return repo
    t0 = time.monotonic()
    sdist = ensure_sdists([task], cache)[task["sdist"]]
    (cache / "repos").mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".build-{tid}-", dir=cache / "repos"))
    try:
        unpack_sdist(sdist, tmp)
        built = tmp / task["sdist_subdir"]
        if not built.is_dir():
            raise BuildError(f"{tid}: {sdist.name} has no top directory {task['sdist_subdir']!r} "
                             f"(has {sorted(p.name for p in tmp.iterdir())})")
        try:
            touched = apply_unified_diff(built, read_patch(task))
        except PatchError as exc:
            raise BuildError(f"{tid}: bug patch {task['bug_patch']} does not apply: {exc}") from exc
        has_git = _git_init(built, task) if git else False
        stamp = _stamp_path(cache, tid)
        stamp.unlink(missing_ok=True)  # invalid from here until the new tree is in place
        if repo.exists():
            old = Path(tempfile.mkdtemp(prefix=f".old-{tid}-", dir=cache / "repos"))
            os.replace(repo, old / "repo")
            shutil.rmtree(old, ignore_errors=True)
        os.replace(built, repo)
        stamp_tmp = stamp.with_suffix(".stamp.tmp")
        stamp_tmp.write_text(json.dumps({
            "task_id": tid, "build_hash": digest, "library": task["library"], "version": task["version"],
            "patched": touched, "git": has_git, "built_at": time.time(),
        }, indent=1))
        os.replace(stamp_tmp, stamp)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    log.info("task_built", task_id=tid, library=task["library"], version=task["version"],
             git=has_git, seconds=round(time.monotonic() - t0, 2), path=str(repo))
    return repo


def build_task(task_id: str, cache_dir: str | os.PathLike | None = None, *, git: bool = True,
               force: bool = False) -> Path:
    """Return the directory of the task's buggy repository, building it if needed (cached)."""
    task = get_task(task_id)
    cache = resolve_cache_dir(cache_dir)
    if not force and _is_current(cache, task, build_hash(task)):  # fast path, no lock
        return cache / "repos" / task_id
    with cache_lock(cache):
        return _build_locked(task, cache, git=git, force=force)


def build_all(cache_dir: str | os.PathLike | None = None, *, task_ids: Iterable[str] | None = None,
              git: bool = True, force: bool = False) -> dict[str, Path]:
    """Build every task (or the given ones); sdists are fetched in one go. {task_id: repo dir}."""
    tasks = load_tasks() if task_ids is None else [get_task(t) for t in task_ids]
    cache = resolve_cache_dir(cache_dir)
    stale = [t for t in tasks if force or not _is_current(cache, t, build_hash(t))]
    out = {t["task_id"]: cache / "repos" / t["task_id"] for t in tasks}
    if not stale:
        return out
    t0 = time.monotonic()
    with cache_lock(cache):
        ensure_sdists(stale, cache)
        for t in stale:
            out[t["task_id"]] = _build_locked(t, cache, git=git, force=force)
    log.info("tasks_built", count=len(stale), seconds=round(time.monotonic() - t0, 2), cache=str(cache))
    return out


def _copy_tree(src: Path, dest: Path) -> None:
    shutil.copytree(src, dest, symlinks=True, dirs_exist_ok=True)


def copy_repo(task_id: str, dest: str | os.PathLike, cache_dir: str | os.PathLike | None = None) -> Path:
    """Copy the task's buggy repository (built if needed) into ``dest``, which becomes the
    repository root (created if missing; existing files are overwritten). Returns ``dest``."""
    src = build_task(task_id, cache_dir)
    dest = Path(dest)
    dest.mkdir(parents=True, exist_ok=True)
    _copy_tree(src, dest)
    return dest
