"""The build: cached, idempotent, safe under concurrent builders (uses the session cache's
sdists as an offline mirror, so only the session fixture may touch the network)."""
from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from rolloutd.handlers.swe_tasks import build_task, copy_repo, get_task, load_tasks, repo_path, restore_tests
from rolloutd.handlers.swe_tasks.build import DownloadError, ensure_sdists
from rolloutd.handlers.swe_tasks.__main__ import main as build_main
from rolloutd.handlers.swe_tasks.taskdefs import build_hash

REPO = Path(__file__).resolve().parents[2]
SMALL = "inflection-ordinal-teens"  # smallest sdist


def _stamp(cache: Path, task_id: str) -> dict:
    return json.loads((cache / "repos" / f"{task_id}.stamp").read_text())


def test_session_cache_has_every_task(swe_cache):
    for t in load_tasks():
        repo = swe_cache / "repos" / t["task_id"]
        assert repo.is_dir()
        assert _stamp(swe_cache, t["task_id"])["build_hash"] == build_hash(t)
        for rel in t["test_files"]:
            assert (repo / rel).exists(), rel
        if (repo / ".git").is_dir():  # the cached repo stays exactly as built
            status = subprocess.run(["git", "status", "--porcelain", "--ignored"], cwd=repo, timeout=60,
                                    capture_output=True, text=True, check=True).stdout
            assert status == "", status


def test_build_is_idempotent_and_cached(swe_cache):
    before = _stamp(swe_cache, SMALL)
    repo = swe_cache / "repos" / SMALL
    inode = repo.stat().st_ino
    assert build_task(SMALL, swe_cache) == repo
    assert repo.stat().st_ino == inode  # no rebuild: the same directory, not a new copy
    assert _stamp(swe_cache, SMALL) == before
    assert repo_path(SMALL, swe_cache) == swe_cache / "repos" / SMALL


def test_fresh_cache_from_mirror_and_rebuild_on_change(tmp_path, swe_sdist_mirror, monkeypatch):
    monkeypatch.setenv("ROLLOUTD_SWE_SDISTS", str(swe_sdist_mirror))
    cache = tmp_path / "cache"
    repo = build_task(SMALL, cache)
    assert (repo / ".git").is_dir() == bool(shutil.which("git"))
    first = _stamp(cache, SMALL)
    assert first["patched"] == ["inflection/__init__.py"]
    assert "% 10 in (11, 12, 13)" in (repo / "inflection/__init__.py").read_text()
    # a stale stamp (task definition changed) triggers a rebuild, in place
    stamp = cache / "repos" / f"{SMALL}.stamp"
    stamp.write_text(json.dumps(dict(first, build_hash="0" * 64)))
    (repo / "marker").write_text("old tree")
    assert build_task(SMALL, cache) == repo
    assert not (repo / "marker").exists()
    assert _stamp(cache, SMALL)["build_hash"] == first["build_hash"]
    assert not [p for p in (cache / "repos").iterdir() if p.name.startswith(".")], "temp dirs left behind"


def test_concurrent_builders_are_serialized(tmp_path, swe_sdist_mirror):
    cache = tmp_path / "cache"
    env = dict(os.environ, ROLLOUTD_SWE_SDISTS=str(swe_sdist_mirror), ROLLOUTD_SWE_CACHE=str(cache))
    code = ("import sys; from rolloutd.handlers.swe_tasks import build_all;"
            "print(sorted(build_all(task_ids=sys.argv[1:])))")
    ids = [SMALL, "toolz-get-in-default", "boltons-parse-int-list-range"]
    procs = [subprocess.Popen([sys.executable, "-c", code, *ids], cwd=REPO, env=env,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for _ in range(3)]
    outs = [p.communicate(timeout=120) for p in procs]
    assert [p.returncode for p in procs] == [0, 0, 0], [o[1][-2000:] for o in outs]
    built = sum((o[0] + o[1]).count("task_built") for o in outs)
    assert built == len(ids), "each task must be built exactly once across the racing builders"
    for tid in ids:
        assert _stamp(cache, tid)["build_hash"] == build_hash(get_task(tid))


def test_copy_repo_and_restore_tests(swe_cache, tmp_path):
    task = get_task(SMALL)
    ws = copy_repo(SMALL, tmp_path / "ws", swe_cache)
    assert (ws / "inflection/__init__.py").is_file()
    test_file = ws / "test_inflection.py"
    original = test_file.read_text()
    test_file.write_text("def test_cheat():\n    pass\n")
    assert restore_tests(SMALL, ws, swe_cache) == task["test_files"]
    assert test_file.read_text() == original
    # the cache itself is untouched by work in the copy
    assert (swe_cache / "repos" / SMALL / "test_inflection.py").read_text() == original


def test_restore_tests_never_writes_through_an_agents_symlink(swe_cache, tmp_path):
    """restore_tests runs on the host (as root in production) over a tree the agent shaped: a test
    file replaced by a symlink to a host file must not send the restore's write to that file, and
    a FIFO in its place must not fail it (shutil refuses to copy onto one; the first part failed
    before restore_tests shared the eval's safe copy)."""
    ws = copy_repo(SMALL, tmp_path / "ws", swe_cache)
    outside = tmp_path / "host-file"
    outside.write_text("host data\n")
    test_file = ws / "test_inflection.py"
    test_file.unlink()
    test_file.symlink_to(outside)
    restore_tests(SMALL, ws, swe_cache)
    assert outside.read_text() == "host data\n"
    assert not test_file.is_symlink()
    assert test_file.read_text() == (swe_cache / "repos" / SMALL / "test_inflection.py").read_text()
    test_file.unlink()
    os.mkfifo(test_file)
    restore_tests(SMALL, ws, swe_cache)
    assert test_file.is_file() and not test_file.is_fifo()


def test_hash_mismatch_is_a_download_error(tmp_path, swe_sdist_mirror, monkeypatch):
    monkeypatch.setenv("ROLLOUTD_SWE_SDISTS", str(tmp_path / "empty-mirror"))
    task = get_task(SMALL)
    cache = tmp_path / "cache"
    (cache / "sdists").mkdir(parents=True)
    # a corrupt cached sdist is not trusted; with the network blocked the build must fail clearly
    (cache / "sdists" / task["sdist"]).write_bytes(b"corrupt")
    monkeypatch.setattr("rolloutd.handlers.swe_tasks.build._pip_download",
                        lambda specs, dest: (_ for _ in ()).throw(DownloadError("offline")))
    with pytest.raises(DownloadError, match="offline"):
        ensure_sdists([task], cache)


def test_cli_list_and_build(swe_cache, capsys):
    assert build_main(["--cache", str(swe_cache), "--list"]) == 0
    assert SMALL in capsys.readouterr().out
    assert build_main(["--cache", str(swe_cache), "--task", SMALL]) == 0
    assert str(swe_cache / "repos" / SMALL) in capsys.readouterr().out
    assert build_main(["--cache", str(swe_cache), "--task", SMALL, "--verify"]) == 0
    assert "1 of 1 tasks verified" in capsys.readouterr().out
