"""What the hard disk bounds cost (issue 24 item 3): sandbox ready time per disk-quota mechanism.

Interleaved round by round in one process (load drift hits every mechanism equally):
  measured  the workspace is a plain host dir, walked by the node (the baseline, no mounts)
  loop      a loop-mounted ext4 image of disk_mb per workspace (root; the default as root)
  tmpfs     a tmpfs of disk_mb per workspace (root; in RAM)
For each: create() -> the tool server answers ping (what bench_sandbox.py calls "ready"),
the first bash `true`, and destroy(). Also the pieces of the loop mechanism alone (mkfs.ext4,
loop set-up + mount, unmount) and the measured walk's cost per entry.

  .venv/bin/python bench/bench_sandbox_disk.py [--quick] [--rounds N] [--disk-mb MB] [--json PATH]
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
from common import loadavg, median, percentile, revision, short_tmpdir  # noqa: E402

from rolloutd.sandbox import Limits, SandboxSpec, ToolClient, bounds, get_runtime  # noqa: E402
from rolloutd.sandbox.runtime import _remove_sandbox_dir, disk_usage  # noqa: E402


def pieces(d: Path, disk_mb: int, n: int) -> dict:
    out: dict = {"mkfs_ms": [], "mount_ms": [], "umount_ms": [], "tmpfs_mount_ms": [], "tmpfs_umount_ms": []}
    uid, gid = os.geteuid(), os.getegid()
    for i in range(n):
        img, ws = d / ("img%d" % i), d / ("ws%d" % i)
        ws.mkdir()
        t0 = time.perf_counter()
        bounds.make_ext4_image(img, disk_mb << 20, uid, gid)
        t1 = time.perf_counter()
        bounds.mount_ext4_image(img, ws)
        t2 = time.perf_counter()
        bounds.unmount_under(ws)
        t3 = time.perf_counter()
        bounds.mount_tmpfs(ws, disk_mb << 20, uid, gid)
        t4 = time.perf_counter()
        bounds.unmount_under(ws)
        t5 = time.perf_counter()
        img.unlink()
        ws.rmdir()
        for k, v in zip(out, (t1 - t0, t2 - t1, t3 - t2, t4 - t3, t5 - t4)):
            out[k].append(v * 1000)
    return {k: round(median(v), 3) for k, v in out.items()}


def walk_cost(d: Path, dirs: int = 100, files: int = 100, n: int = 5) -> dict:
    t = d / "tree"
    for i in range(dirs):
        (t / str(i)).mkdir(parents=True)
        for j in range(files):
            (t / str(i) / str(j)).write_bytes(b"x")
    xs = []
    for _ in range(n):
        t0 = time.perf_counter()
        disk_usage(t)
        xs.append((time.perf_counter() - t0) * 1000)
    return {"entries": dirs * files + dirs, "walk_ms": round(median(xs), 2),
            "us_per_entry": round(median(xs) * 1000 / (dirs * files + dirs), 2)}


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--quick", action="store_true", help="a smoke run: 3 rounds")
    p.add_argument("--rounds", type=int, default=30)
    p.add_argument("--disk-mb", type=int, default=4096)
    p.add_argument("--json", default=None)
    a = p.parse_args()
    rounds = 3 if a.quick else a.rounds
    modes = ["measured"] + (["loop", "tmpfs"] if bounds.why_no_mounts() is None else [])
    root = short_tmpdir("rbd-")
    os.chmod(root, 0o755)
    res: dict = {"revision": revision(Path(__file__).resolve().parent.parent), "load_at_start": loadavg(),
                 "disk_mb": a.disk_mb, "rounds": rounds, "modes": {}}
    try:
        rts = {m: get_runtime("bwrap", root_dir=root / m, disk_quota=m, ready_timeout=60) for m in modes}
        samples = {m: {"ready": [], "first_true": [], "destroy": []} for m in modes}
        for m in modes:  # warm-up (tool library, page cache)
            rts[m].destroy(rts[m].create("warm", SandboxSpec(limits=Limits(disk_mb=a.disk_mb))))
        for r in range(rounds):
            for m in (modes if r % 2 == 0 else modes[::-1]):
                rt = rts[m]
                t0 = time.perf_counter()
                h = rt.create("b%d" % r, SandboxSpec(limits=Limits(disk_mb=a.disk_mb)))  # returns after a ping
                t1 = time.perf_counter()
                with ToolClient(h.tool_socket, timeout=30) as c:
                    c.call("bash", {"command": "true", "timeout": 30})
                t2 = time.perf_counter()
                rt.destroy(h)
                t3 = time.perf_counter()
                for k, v in zip(("ready", "first_true", "destroy"), (t1 - t0, t2 - t0, t3 - t2)):
                    samples[m][k].append(v * 1000)
        for m in modes:
            s = samples[m]
            res["modes"][m] = {"ready_median_ms": round(median(s["ready"]), 1),
                               "ready_p90_ms": round(percentile(s["ready"], 90), 1),
                               "first_true_median_ms": round(median(s["first_true"]), 1),
                               "destroy_median_ms": round(median(s["destroy"]), 1)}
        base = res["modes"]["measured"]["ready_median_ms"]
        for m in modes:
            res["modes"][m]["ready_vs_measured"] = round(res["modes"][m]["ready_median_ms"] / base, 2)
        scratch = root / "pieces"
        scratch.mkdir()
        if "loop" in modes:
            res["loop_pieces"] = pieces(scratch, a.disk_mb, 5 if a.quick else 20)
        res["walk"] = walk_cost(scratch)
        res["load_at_end"] = loadavg()
    finally:
        _remove_sandbox_dir(root)
    print(json.dumps(res, indent=1))
    if a.json:
        Path(a.json).write_text(json.dumps(res, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
