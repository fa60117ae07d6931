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
Mount and loop set-up go through libc, ioctls and syscalls directly: the ``mount`` command costs
a fork/exec (~3 ms) each time.

A workspace filesystem is made in two steps: ``prepare_ext4`` (copy the template, attach a loop
device, mount it *detached* with the new mount API: an fd, in no mount table) and
``ReadyFs.install`` (one ``move_mount`` onto the workspace dir). ``WorkspacePool`` runs the first
step ahead of demand in a background thread, so a sandbox start pays only the second. A pooled
filesystem lives only in this process's fds: when the process dies, however, the kernel drops
the detached mount, the loop device (autoclear) and the image (an O_TMPFILE). See
docs/SANDBOX.md, "Disk quota".
"""
from __future__ import annotations

import collections
import contextlib
import ctypes
import errno
import fcntl
import os
import shutil
import struct
import subprocess
import threading
from pathlib import Path
from typing import Deque, Dict, List, Optional, Tuple, Union

from .log import log

RUN_DIR_BYTES = 1 << 20   # tool.sock, config.json (~2 KB), llm.sock
MIN_IMAGE_BYTES = 4 << 20  # below this a workspace gets a tmpfs (ext4 needs room for its metadata)
RUN_DIR_INODES = 64

MS_NOSUID, MS_NODEV, MS_NOEXEC, MNT_DETACH = 0x2, 0x4, 0x8, 0x2
LOOP_CTL_GET_FREE, LOOP_CONFIGURE = 0x4C82, 0x4C0A
LO_FLAGS_AUTOCLEAR = 4

# The new mount API (Linux >= 5.2; LOOP_CONFIGURE already needs 5.8): one syscall table on every arch.
SYS_MOVE_MOUNT, SYS_FSOPEN, SYS_FSCONFIG, SYS_FSMOUNT = 429, 430, 431, 432
FSOPEN_CLOEXEC, FSMOUNT_CLOEXEC, MOVE_MOUNT_F_EMPTY_PATH, AT_FDCWD, AT_SYMLINK_FOLLOW = 1, 1, 4, -100, 0x400
FSCONFIG_SET_FLAG, FSCONFIG_SET_STRING, FSCONFIG_CMD_CREATE = 0, 1, 6
MOUNT_ATTR_NOSUID, MOUNT_ATTR_NODEV = 0x2, 0x4

_libc = ctypes.CDLL(None, use_errno=True)
_libc.mount.argtypes = (ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p)
_libc.umount2.argtypes = (ctypes.c_char_p, ctypes.c_int)
_libc.syscall.restype = ctypes.c_long
_libc.linkat.argtypes = (ctypes.c_int, ctypes.c_char_p, ctypes.c_int, ctypes.c_char_p, ctypes.c_int)


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


def template_image(templates: os.PathLike, size_bytes: int, uid: int, gid: int) -> Path:
    """The empty ext4 of (size, owner) under templates, made once (mkfs.ext4 is a fork/exec of
    4-20 ms); each workspace is a sparse copy of it. Its lost+found is removed once here, so a
    workspace mounts without a write (an agent's `ls` should see an empty workspace)."""
    t = Path(templates) / ("ext4-%d-%d-%d.img" % (size_bytes, uid, gid))
    if not t.exists():
        Path(templates).mkdir(mode=0o700, exist_ok=True)
        tmp = t.with_name(".%s.%s" % (t.name, os.urandom(6).hex()))  # unique per thread too
        try:
            make_ext4_image(tmp, size_bytes, uid, gid)
            mfd = _detached_ext4(tmp)
            try:
                os.rmdir("lost+found", dir_fd=mfd)
                _sync_fs(mfd)
            finally:
                os.close(mfd)  # unmounted here, the loop device goes (autoclear)...
            os.replace(tmp, t)  # concurrent makers: identical content, last rename wins
        except BaseException:
            try:
                os.unlink(tmp)
            except OSError:
                pass
            raise
    return t


def _sync_fs(mount_fd: int) -> None:
    """Write the mounted filesystem's changes into its image now (syncfs). ...unless a child
    forked meanwhile still holds the mount: its unmount, and the write-back, then come later,
    and a copy of the image taken before them was torn (CI: a workspace whose root still listed
    lost+found, and pytest's collection stat of it failed with EBADMSG)."""
    fd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=mount_fd)
    try:
        _checked(_libc.syncfs(fd))
    finally:
        os.close(fd)


def make_ext4_image(image: os.PathLike, size_bytes: int, uid: int, gid: int,
                    templates: Optional[os.PathLike] = None) -> None:
    """A sparse file of exactly size_bytes holding an empty ext4 (4 KiB blocks, one inode per
    16 KiB but at least 1024, no journal: the data is as ephemeral as the sandbox; no reserved blocks).

    With a templates dir, the image is a sparse copy of template_image() (~0.2 MB of metadata for
    4 GB: well under a millisecond). ext4 does not mind two mounted filesystems sharing a UUID."""
    if templates is not None:
        _sparse_copy(template_image(templates, size_bytes, uid, gid), image, size_bytes)
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


def _sparse_copy(src: os.PathLike, dst: Union[os.PathLike, int], size: int) -> None:
    """Copy only src's data extents (SEEK_DATA/SEEK_HOLE): dst (a path, or an open fd that is
    left open) stays as sparse as src."""
    fi = os.open(src, os.O_RDONLY | os.O_CLOEXEC)
    try:
        fo = dst if isinstance(dst, int) else os.open(dst, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
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
            if fo is not dst:
                os.close(fo)
    finally:
        os.close(fi)


def _loop_config(fd: int) -> bytes:
    # struct loop_config { u32 fd; u32 block_size; struct loop_info64 info; u64 reserved[8]; }
    info = struct.pack("=5Q4I64s64s32s2Q", 0, 0, 0, 0, 0, 0, 0, 0, LO_FLAGS_AUTOCLEAR, b"", b"", b"", 0, 0)
    return struct.pack("=II", fd, 0) + info + b"\0" * 64


def attach_loop(image: Union[os.PathLike, int]) -> Tuple[str, int]:
    """A free loop device bound to image (a path or an open read-write fd) and an open fd of it.
    With LO_FLAGS_AUTOCLEAR the kernel detaches the device when its last user goes (the last
    close or unmount), so the caller keeps the fd open until the device is mounted. Retries when
    another process takes the same free device."""
    img = image if isinstance(image, int) else os.open(image, os.O_RDWR | os.O_CLOEXEC)
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
        if img is not image:
            os.close(img)


def _checked(r: int) -> int:
    """A libc call's result, or its errno raised as OSError when it failed (< 0)."""
    if r < 0:
        e = ctypes.get_errno()
        raise OSError(e, os.strerror(e))
    return r


def _syscall(nr: int, *args) -> int:
    return _checked(_libc.syscall(nr, *args))


def _detached_ext4(image: Union[os.PathLike, int]) -> int:
    """image on a fresh loop device, mounted (nosuid, nodev, discard) nowhere: an fd of the new
    mount (fsopen/fsconfig/fsmount), in no mount table until move_mount attaches it. Closing the
    fd before that unmounts it, and the loop device goes with it (autoclear)."""
    dev, lfd = attach_loop(image)
    try:  # on failure the close below is the device's last use: autoclear frees it
        fs = _syscall(SYS_FSOPEN, b"ext4", FSOPEN_CLOEXEC)
        try:
            try:
                _syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_STRING, b"source", dev.encode(), 0)
                _syscall(SYS_FSCONFIG, fs, FSCONFIG_SET_FLAG, b"discard", None, 0)
                _syscall(SYS_FSCONFIG, fs, FSCONFIG_CMD_CREATE, None, None, 0)
                return _syscall(SYS_FSMOUNT, fs, FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV)
            except OSError as e:
                why = _fs_messages(fs)
                raise BoundsError(e.errno, "mount ext4 from %s: %s%s" % (dev, e.strerror, (" (%s)" % why) if why else ""))
        finally:
            os.close(fs)
    finally:
        os.close(lfd)


def _fs_messages(fs: int) -> str:
    out = []
    fl = fcntl.fcntl(fs, fcntl.F_GETFL)
    fcntl.fcntl(fs, fcntl.F_SETFL, fl | os.O_NONBLOCK)
    for _ in range(8):
        try:
            out.append(os.read(fs, 512).decode(errors="replace").strip())
        except OSError:
            break
    return "; ".join(m for m in out if m)


class ReadyFs:
    """A workspace filesystem made but mounted nowhere: the detached mount's fd, and the image's
    fd when the image has no name yet (an O_TMPFILE of the pool)."""

    __slots__ = ("mount_fd", "image_fd", "key")

    def __init__(self, mount_fd: int, image_fd: Optional[int], key: Tuple[int, int, int]) -> None:
        self.mount_fd, self.image_fd, self.key = mount_fd, image_fd, key

    def install(self, target: os.PathLike, image_path: Optional[os.PathLike] = None) -> None:
        """Attach the filesystem on target (one move_mount) and give a nameless image its name
        (image_path, on the same filesystem as the image). Closes the fds either way."""
        try:
            try:
                _syscall(SYS_MOVE_MOUNT, self.mount_fd, b"", AT_FDCWD, os.fsencode(str(target)), MOVE_MOUNT_F_EMPTY_PATH)
            except OSError as e:
                raise BoundsError(e.errno, "move_mount onto %s: %s" % (target, e.strerror))
            if self.image_fd is not None and image_path is not None:
                # os.link() would link the /proc symlink itself (link(2) does not follow it)
                if _libc.linkat(AT_FDCWD, b"/proc/self/fd/%d" % self.image_fd, AT_FDCWD,
                                os.fsencode(str(image_path)), AT_SYMLINK_FOLLOW) != 0:
                    e = ctypes.get_errno()
                    raise BoundsError(e, "link the workspace image as %s: %s" % (image_path, os.strerror(e)))
        finally:
            self.close()

    def close(self) -> None:
        for fd in (self.mount_fd, self.image_fd):
            if fd is not None:
                os.close(fd)
        self.mount_fd = self.image_fd = None


def prepare_ext4(templates: os.PathLike, size_bytes: int, uid: int, gid: int,
                 image: Optional[os.PathLike] = None) -> ReadyFs:
    """A copy of the (size, owner) template, loop-attached and mounted detached. image: where
    the copy goes; None: a nameless file (O_TMPFILE) in templates, freed by the kernel with its
    last reference (install() names it)."""
    t = template_image(templates, size_bytes, uid, gid)
    key = (size_bytes, uid, gid)
    if image is None:
        ifd = os.open(templates, os.O_TMPFILE | os.O_RDWR | os.O_CLOEXEC, 0o600)
    else:
        ifd = os.open(image, os.O_RDWR | os.O_CREAT | os.O_TRUNC | os.O_CLOEXEC, 0o600)
    try:
        _sparse_copy(t, ifd, size_bytes)
        mfd = _detached_ext4(ifd)
    except BaseException:
        os.close(ifd)
        raise
    try:  # read the root dir now: the tool server's first look at /workspace is then a cache hit
        dfd = os.open(".", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC, dir_fd=mfd)
        try:
            os.listdir(dfd)
        finally:
            os.close(dfd)
    except OSError:
        pass
    if image is not None:
        os.close(ifd)
        ifd = None
    return ReadyFs(mfd, ifd, key)


def mount_ext4_image(image: os.PathLike, target: os.PathLike) -> None:
    """Mount an existing image file on target (via a detached mount, like a pooled one)."""
    ReadyFs(_detached_ext4(image), None, (0, 0, 0)).install(target)
    try:  # an image made without a template still has its lost+found
        os.rmdir(os.path.join(str(target), "lost+found"))
    except OSError:
        pass


class WorkspacePool:
    """Workspace filesystems made ahead of demand (prepare_ext4 with a nameless image), per
    (size, uid, gid), `depth` of each of the `kinds` most recently asked for. take() never waits:
    an empty pool means the caller makes its own. refill() wakes a background thread that runs
    at a lower priority (nice +10), so on a busy node it takes CPU from sandbox starts last.
    Everything it holds is fds of this process: close() (or the process's death) frees all."""

    def __init__(self, templates: os.PathLike, depth: int = 2, kinds: int = 4) -> None:
        self.templates, self.depth, self.kinds = Path(templates), int(depth), int(kinds)
        self._cv = threading.Condition()
        self._ready: "collections.OrderedDict[Tuple[int, int, int], Deque[ReadyFs]]" = collections.OrderedDict()
        self._failed: Dict[Tuple[int, int, int], str] = {}  # kinds that failed: not retried until refill()
        self.off: Optional[str] = None  # why the pool cannot work here at all (no O_TMPFILE on the root's fs)
        self._thread: Optional[threading.Thread] = None
        self._pid = os.getpid()
        self._closed = False
        self.max_defer = 0.5
        self._starting = 0  # sandbox starts in progress: the filler waits for a gap between them
        self.hits = self.misses = 0

    @contextlib.contextmanager
    def hold(self):
        """Around a sandbox start: the filler does not begin making a filesystem meanwhile (it
        waits at most max_defer seconds: under a stream of starts it must still make progress)."""
        with self._cv:
            self._starting += 1
        try:
            yield
        finally:
            with self._cv:
                self._starting -= 1
                self._cv.notify_all()

    def take(self, size_bytes: int, uid: int, gid: int) -> Optional[ReadyFs]:
        key = (size_bytes, uid, gid)
        evicted: List[ReadyFs] = []
        with self._cv:
            self._after_fork()
            if self._closed or self.off:
                return None
            q = self._ready.setdefault(key, collections.deque())
            self._ready.move_to_end(key)
            while len(self._ready) > self.kinds:  # a kind not asked for lately gives its slots up
                evicted.extend(self._ready.popitem(last=False)[1])
            r = q.popleft() if q else None
            if r is None:
                self.misses += 1
            else:
                self.hits += 1
        for e in evicted:
            e.close()
        self.refill()  # waits for the start in progress to end (hold)
        return r

    def refill(self) -> None:
        with self._cv:
            self._after_fork()
            if self._closed:
                return
            self._failed.clear()
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="rolloutd-workspace-pool", daemon=True)
                self._thread.start()
            self._cv.notify()

    def size(self) -> int:
        with self._cv:
            return sum(len(q) for q in self._ready.values())

    def close(self) -> None:
        with self._cv:
            self._closed = True
            held = [r for q in self._ready.values() for r in q]
            self._ready.clear()
            self._cv.notify_all()
        for r in held:
            r.close()

    def _after_fork(self) -> None:
        if self._pid != os.getpid():  # a forked child: the thread is not here; the fds are shared copies
            self._pid, self._thread = os.getpid(), None

    def _next(self) -> Optional[Tuple[int, int, int]]:
        for key, q in reversed(self._ready.items()):  # the most recently asked for first
            if len(q) < self.depth and key not in self._failed:
                return key
        return None

    def _run(self) -> None:
        try:
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), 10)  # this thread only (Linux)
        except OSError:
            pass
        while True:
            with self._cv:
                key = self._next()
                while not self._closed and key is None:
                    if not self._cv.wait(timeout=60):
                        self._thread = None
                        return  # idle: a later refill() starts a new thread
                    key = self._next()
                if self._starting:  # a sandbox is starting: make room for it first
                    self._cv.wait_for(lambda: self._closed or not self._starting, timeout=self.max_defer)
                if self._closed:
                    return
            try:
                r = prepare_ext4(self.templates, *key)
            except Exception as e:  # e.g. a full sandbox root: creates make their own, and say why
                off = isinstance(e, OSError) and e.errno in (errno.EOPNOTSUPP, errno.EISDIR)  # no O_TMPFILE
                with self._cv:
                    self._failed[key] = repr(e)
                    if off:
                        self.off = "no O_TMPFILE in %s: %r" % (self.templates, e)
                log.warning("workspace_pool_off" if off else "workspace_pool_fill_failed", size_bytes=key[0],
                            error=repr(e))
                if off:
                    self.close()
                    return
                continue
            with self._cv:
                q = self._ready.get(key)
                if not self._closed and q is not None and len(q) < self.depth:
                    q.append(r)
                    r = None
            if r is not None:
                r.close()


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
