"""Hard bounds on what a sandbox can write to the host (root only).

A sandbox's host-side writable dirs are its workspace and its run dir (tool.sock, config.json,
llm.sock). As root the runtime mounts a filesystem of fixed size on each, so a write past the
bound fails with ENOSPC inside the sandbox and the host never holds a byte more:

* workspace: a loop-mounted ext4 image (a sparse file of exactly ``Limits.disk_mb``, no journal,
  no reserved blocks, ``discard`` so deleted files give their blocks back to the host), or a
  size-limited tmpfs (``disk_quota="tmpfs"``: in RAM);
* run dir: a tmpfs of 1 MiB and 64 inodes.

Both are ordinary mounts in the host's mount namespace at the same paths as before, so init
fills the workspace and eval reads it as it always did. ``unmount_under(dir)`` reads the mount
table, so destroy, reap and the janitor undo them without any state (also after a crash).
Mount and loop set-up go through libc and ioctls directly: the ``mount`` command costs a
fork/exec (~3 ms) each time. See docs/SANDBOX.md, "Disk quota".
"""
from __future__ import annotations

import ctypes
import errno
import fcntl
import os
import shutil
import struct
import subprocess
from pathlib import Path
from typing import List, Optional, Tuple

RUN_DIR_BYTES = 1 << 20   # tool.sock, config.json (~2 KB), llm.sock
MIN_IMAGE_BYTES = 4 << 20  # below this a workspace gets a tmpfs (ext4 needs room for its metadata)
RUN_DIR_INODES = 64

MS_NOSUID, MS_NODEV, MS_NOEXEC, MNT_DETACH = 0x2, 0x4, 0x8, 0x2
LOOP_CTL_GET_FREE, LOOP_CONFIGURE = 0x4C82, 0x4C0A
LO_FLAGS_AUTOCLEAR = 4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)


class BoundsError(OSError):
    pass


def _mount(source: str, target: str, fstype: str, flags: int, data: str) -> None:
    if _libc.mount(source.encode(), str(target).encode(), fstype.encode(), flags, data.encode()) != 0:
        e = ctypes.get_errno()
        raise BoundsError(e, "mount %s on %s: %s" % (fstype, target, os.strerror(e)))


def mkfs_ext4() -> Optional[str]:
    return shutil.which("mkfs.ext4", path=os.environ.get("PATH", "") + ":/usr/sbin:/sbin")


def why_no_mounts() -> Optional[str]:
    """None when this process can make the hard bounds, else why not (no side effect)."""
    if os.geteuid() != 0:
        return "not root (mounting needs CAP_SYS_ADMIN in the host's namespace)"
    if not os.path.exists("/dev/loop-control"):
        return "no /dev/loop-control (loop module not loaded)"
    if mkfs_ext4() is None:
        return "mkfs.ext4 not found (e2fsprogs)"
    try:  # a private mount namespace (systemd PrivateTmp=, unshare -m): the other daemons would
        # not see the workspace mounts and would read the empty dir beneath them
        if os.readlink("/proc/self/ns/mnt") != os.readlink("/proc/1/ns/mnt"):
            return "this process has its own mount namespace (not pid 1's): other daemons would not see its mounts"
    except OSError:
        pass  # pid 1 not inspectable (no CAP_SYS_PTRACE over it): no verdict
    return None


def mount_tmpfs(target: os.PathLike, size_bytes: int, uid: int, gid: int, nr_inodes: Optional[int] = None) -> None:
    data = "size=%d,mode=0755,uid=%d,gid=%d" % (size_bytes, uid, gid)
    if nr_inodes:
        data += ",nr_inodes=%d" % nr_inodes
    _mount("tmpfs", str(target), "tmpfs", MS_NOSUID | MS_NODEV, data)


def mount_devpts(target: os.PathLike, max_ptys: int) -> None:
    """A devpts instance of its own with at most max_ptys ptys (the kernel's kernel.pty.max is
    node-wide: without max= one sandbox could take every pty of the node). ptmx is 0666 so the
    sandbox's uid can open it; each pty belongs to the uid that opened it."""
    _mount("devpts", str(target), "devpts", MS_NOSUID | MS_NOEXEC,
           "newinstance,ptmxmode=0666,mode=0620,max=%d" % int(max_ptys))


def make_ext4_image(image: os.PathLike, size_bytes: int, uid: int, gid: int,
                    templates: Optional[os.PathLike] = None) -> None:
    """A sparse file of exactly size_bytes holding an empty ext4 (4 KiB blocks, one inode per
    16 KiB but at least 1024, no journal: the data is as ephemeral as the sandbox; no reserved blocks).

    With a templates dir, mkfs runs once per (size, owner) and each image is a sparse copy of
    that template (~0.2 MB of metadata for 4 GB: well under a millisecond, where mkfs.ext4 is
    a fork/exec of 4-20 ms). ext4 does not mind two mounted filesystems sharing a UUID."""
    if templates is not None:
        t = Path(templates) / ("ext4-%d-%d-%d.img" % (size_bytes, uid, gid))
        if not t.exists():
            Path(templates).mkdir(mode=0o700, exist_ok=True)
            tmp = t.with_name(".%s.%s" % (t.name, os.urandom(6).hex()))  # unique per thread too
            make_ext4_image(tmp, size_bytes, uid, gid)
            os.replace(tmp, t)  # concurrent makers: identical content, last rename wins
        _sparse_copy(t, image, size_bytes)
        return
    with open(image, "wb") as f:
        f.truncate(size_bytes)
    inodes = max(1024, size_bytes // 16384)  # small images: room for a few files anyway
    r = subprocess.run([mkfs_ext4() or "mkfs.ext4", "-q", "-F", "-t", "ext4", "-b", "4096", "-N", str(inodes),
                        "-I", "256", "-m", "0", "-O", "^has_journal,^resize_inode",
                        "-E", "lazy_itable_init=1,nodiscard,root_owner=%d:%d" % (uid, gid), str(image)],
                       capture_output=True, text=True, timeout=60)
    if r.returncode != 0:
        raise BoundsError(errno.EIO, "mkfs.ext4 %s failed: %s" % (image, (r.stderr or r.stdout).strip()[-300:]))


def _sparse_copy(src: os.PathLike, dst: os.PathLike, size: int) -> None:
    """Copy only src's data extents (SEEK_DATA/SEEK_HOLE): dst stays as sparse as src."""
    fi = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fo = os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
        try:
            os.ftruncate(fo, size)
            pos = 0
            while pos < size:
                try:
                    start = os.lseek(fi, pos, os.SEEK_DATA)
                except OSError as e:
                    if e.errno == errno.ENXIO:  # no data past pos
                        break
                    raise
                end = os.lseek(fi, start, os.SEEK_HOLE)
                off_in, off_out = start, start
                while off_in < end:
                    n = os.copy_file_range(fi, fo, end - off_in, off_in, off_out)
                    if n <= 0:
                        raise BoundsError(errno.EIO, "short copy of %s" % src)
                    off_in += n
                    off_out += n
                pos = end
        finally:
            os.close(fo)
    finally:
        os.close(fi)


def _loop_config(fd: int) -> bytes:
    # struct loop_config { u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]; }
    info = struct.pack("=5Q4I64s64s32s2Q", 0, 0, 0, 0, 0, 0, 0, 0, LO_FLAGS_AUTOCLEAR, b"", b"", b"", 0, 0)
    return struct.pack("=II", fd, 0) + info + b"\0" * 64


def attach_loop(image: os.PathLike) -> Tuple[str, int]:
    """A free loop device bound to image and an open fd of it. With LO_FLAGS_AUTOCLEAR the
    kernel detaches the device when its last user goes (the last close or unmount), so the
    caller keeps the fd open until the device is mounted. Retries when another process takes
    the same free device."""
    img = os.open(image, os.O_RDWR | os.O_CLOEXEC)
    try:
        ctl = os.open("/dev/loop-control", os.O_RDWR | os.O_CLOEXEC)
        try:
            for _ in range(64):
                n = fcntl.ioctl(ctl, LOOP_CTL_GET_FREE)
                dev = "/dev/loop%d" % n
                try:
                    lfd = os.open(dev, os.O_RDWR | os.O_CLOEXEC)
                except FileNotFoundError:
                    continue
                try:
                    fcntl.ioctl(lfd, LOOP_CONFIGURE, _loop_config(img))
                    return dev, lfd
                except OSError as e:
                    os.close(lfd)
                    if e.errno != errno.EBUSY:
                        raise BoundsError(e.errno, "LOOP_CONFIGURE %s: %s" % (dev, os.strerror(e.errno)))
            raise BoundsError(errno.EBUSY, "no free loop device after 64 tries")
        finally:
            os.close(ctl)
    finally:
        os.close(img)


def mount_ext4_image(image: os.PathLike, target: os.PathLike) -> str:
    dev, lfd = attach_loop(image)
    try:  # on failure the close below is the device's last use: autoclear frees it
        _mount(dev, str(target), "ext4", MS_NOSUID | MS_NODEV, "discard")
    finally:
        os.close(lfd)
    lost = Path(target) / "lost+found"  # an agent's `ls` should see an empty workspace
    try:
        lost.rmdir()
    except OSError:
        pass
    return dev


def _unescape(field: str) -> str:
    # mountinfo escapes space, tab, newline and backslash as \ooo
    out, i = [], 0
    while i < len(field):
        if field[i] == "\\" and i + 3 < len(field) + 1 and field[i + 1:i + 4].isdigit():
            out.append(chr(int(field[i + 1:i + 4], 8)))
            i += 4
        else:
            out.append(field[i])
            i += 1
    return "".join(out)


def mount_table(path: str = "/proc/self/mountinfo") -> List[Tuple[str, str, str, str]]:
    """(mount point, fstype, mount options, super options) for each line of a mountinfo file."""
    out = []
    try:
        with open(path, "r", encoding="utf-8", errors="surrogateescape") as f:
            lines = f.read().splitlines()
    except OSError:
        return out
    for line in lines:
        left, _, right = line.partition(" - ")
        parts, rparts = left.split(), right.split()
        if len(parts) >= 6 and len(rparts) >= 3:
            out.append((_unescape(parts[4]), rparts[0], parts[5], rparts[2]))
    return out


def mounts_under(d: os.PathLike) -> List[str]:
    base = os.path.abspath(str(d)).rstrip("/") + "/"
    return [mp for mp, *_ in mount_table() if (mp + "/").startswith(base)]


def unmount_under(d: os.PathLike) -> List[str]:
    """Detach every mount at or below d, deepest first (lazily: a host process still reading a
    file, e.g. eval, keeps its view; the space comes back when it lets go). Returns what was
    unmounted; an error other than 'not mounted' is raised after trying the rest."""
    done, failed = [], None
    for mp in sorted(set(mounts_under(d)), key=len, reverse=True):
        for _ in range(8):  # stacked mounts on one point: one umount each
            if _libc.umount2(mp.encode(), MNT_DETACH) != 0:
                e = ctypes.get_errno()
                if e not in (errno.EINVAL, errno.ENOENT):
                    failed = BoundsError(e, "umount %s: %s" % (mp, os.strerror(e)))
                break
            done.append(mp)
            if mp not in mounts_under(mp):
                break
    if failed is not None:
        raise failed
    return done
