"""The loopback allocator: unique under threads and processes, release, stale reclaim."""
import ipaddress
import multiprocessing
import os
import subprocess
import threading

import pytest

from rolloutd.sandbox.loopback import LoopbackAllocator, LoopbackExhausted


def test_unique_under_threads(tmp_path):
    alloc = LoopbackAllocator(tmp_path)
    got, errors = [], []

    def worker(i):
        try:
            for j in range(25):
                got.append(alloc.allocate("t%d-%d" % (i, j)))
        except Exception as e:  # pragma: no cover - reported below
            errors.append(e)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert not errors
    assert len(got) == 200 and len(set(got)) == 200
    assert set(alloc.allocated()) == set(got)
    for a in got:
        ip = ipaddress.IPv4Address(a)
        assert ip.is_loopback and 0 < int(ip) & 0xFF < 255


def _proc_worker(state_dir, n, q):
    # Separate allocator objects in separate processes, same state file.
    alloc = LoopbackAllocator(state_dir)
    q.put([alloc.allocate("p%d-%d" % (os.getpid(), j), pid=os.getppid()) for j in range(n)])


def test_unique_across_processes(tmp_path):
    ctx = multiprocessing.get_context("fork")
    q = ctx.Queue()
    ps = [ctx.Process(target=_proc_worker, args=(str(tmp_path), 30, q)) for _ in range(4)]
    for p in ps:
        p.start()
    results = [q.get(timeout=30) for _ in ps]
    for p in ps:
        p.join(10)
    flat = [a for r in results for a in r]
    assert len(flat) == 120 and len(set(flat)) == 120
    assert len(LoopbackAllocator(tmp_path).allocated()) == 120


def test_release_and_round_robin(tmp_path):
    alloc = LoopbackAllocator(tmp_path, first="127.5.0.1", last="127.5.0.4")
    a = alloc.allocate("x")
    assert alloc.release(a) is True
    assert alloc.release(a) is False
    b = alloc.allocate("y")
    assert b != a  # a just-released address is not handed out again at once
    assert alloc.release(None) is False
    assert alloc.release(b, owner="someone-else") is False  # a stale handle cannot free it
    assert alloc.release(b, owner="y") is True


def test_range_skips_network_and_broadcast_octets(tmp_path):
    alloc = LoopbackAllocator(tmp_path, first="127.6.0.254", last="127.6.1.2")
    got = [alloc.allocate(str(i)) for i in range(3)]
    assert got == ["127.6.0.254", "127.6.1.1", "127.6.1.2"]
    with pytest.raises(LoopbackExhausted):
        alloc.allocate("more")


def test_stale_entries_are_reclaimed(tmp_path):
    alloc = LoopbackAllocator(tmp_path / "state", first="127.7.0.1", last="127.7.0.3")
    dead = subprocess.Popen(["true"])
    dead.wait()
    gone_dir = tmp_path / "sandbox-that-was-removed"
    live_dir = tmp_path / "live"
    live_dir.mkdir()
    a_dead = alloc.allocate("dead-owner", pid=dead.pid)
    a_gone = alloc.allocate("dir-gone", path=str(gone_dir))
    a_live = alloc.allocate("live", path=str(live_dir))  # owned by this (live) process
    assert sorted(alloc.reclaim_stale()) == sorted([a_dead, a_gone])  # the janitor's sweep
    assert set(alloc.allocated()) == {a_live}
    # and, without the sweep, an exhausted pool reclaims stale entries by itself
    b1, b2 = alloc.allocate("b1", pid=dead.pid), alloc.allocate("b2", path=str(gone_dir))
    a_new = alloc.allocate("new")
    assert a_new in (b1, b2)
    assert set(alloc.allocated()) == {a_live, a_new}


def test_update_hands_ownership_to_the_sandbox(tmp_path):
    alloc = LoopbackAllocator(tmp_path)
    sleeper = subprocess.Popen(["sleep", "30"])
    try:
        a = alloc.allocate("sb")
        alloc.update(a, sleeper.pid)
        assert alloc.allocated()[a]["pid"] == sleeper.pid
        assert alloc.reclaim_stale() == []
    finally:
        sleeper.kill()
        sleeper.wait()
    assert alloc.reclaim_stale() == [a]


def test_bad_range(tmp_path):
    with pytest.raises(ValueError):
        LoopbackAllocator(tmp_path, first="10.0.0.1", last="10.0.0.9")
    with pytest.raises(ValueError):
        LoopbackAllocator(tmp_path, first="127.0.0.9", last="127.0.0.1")


def test_corrupt_state_file_is_survivable(tmp_path):
    (tmp_path / "loopback.json").write_text("{not json")
    assert LoopbackAllocator(tmp_path).allocate("x").startswith("127.")
