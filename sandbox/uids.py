"""One host uid per sandbox (root only): per-uid kernel limits become per-sandbox limits.

The kernel counts several limits per host uid, across every namespace that uid created:
epoll watches (fs.epoll.max_user_watches), inotify instances and watches
(fs.inotify.max_user_*), pipe pages (fs.pipe-user-pages-soft), RLIMIT_NPROC's count, POSIX
message-queue bytes (RLIMIT_MSGQUEUE), keys (kernel.keys.maxkeys/maxbytes), pending signals.
Sandboxes that all run as one uid (nobody) share them: one sandbox taking them all breaks the
others (asyncio.run() ENOSPC, inotify EMFILE, 8 KiB pipes). As root, each sandbox of a node gets
its own uid (and gid, the same number) from a range the operator configures, like subuids.

The range is node-wide, shared by every daemon and every deployment on the node: the state
lives in /run/rolloutd-uids (slots.SlotAllocator: a JSON file under an flock). An entry is held
while its sandbox dir exists; destroy() releases it once the dir is gone, and a crashed
daemon's entries become stale when the janitor removes their dirs. See docs/SANDBOX.md,
"Round 2: one host uid per sandbox".
"""
from __future__ import annotations

import os
import pwd
import time
from pathlib import Path
from typing import Any, Optional, Set, Tuple

from .errors import SandboxSpecError, SandboxStartError
from .slots import SlotAllocator

# Above what Debian's useradd hands out as subuids (100000-600100000) and systemd's container
# range (524288-1879048191), below 2^31 (signed-uid trouble); no account of a fresh Debian has one.
DEFAULT_UID_RANGE = "2000000000-2000065535"
STATE_DIR = "/run/rolloutd-uids"
_RESERVED = (0, 65534, 2**32 - 1, 2**32 - 2)  # root, nobody/overflow, (uid_t)-1, -2


class UidsExhausted(SandboxStartError):
    """Every uid of the range belongs to a sandbox whose dir still exists: no start until one goes."""


def parse_uid_range(value: Any) -> Optional[Tuple[int, int]]:
    """ "FIRST-LAST" (or a pair) -> (first, last); "" / None / "off" -> None (one shared uid)."""
    if value is None or value is False or (isinstance(value, str) and value.strip().lower() in ("", "off", "none")):
        return None
    try:
        if isinstance(value, str):
            a, _, b = value.strip().partition("-")
            first, last = int(a), int(b)
        else:
            first, last = (int(x) for x in value)
    except (TypeError, ValueError):
        raise SandboxSpecError("uid_range must be \"FIRST-LAST\" (e.g. %r) or \"\" for one shared uid, got %r"
                               % (DEFAULT_UID_RANGE, value)) from None
    if not 0 < first <= last < 2**32 - 2:
        raise SandboxSpecError("uid_range %r: need 0 < FIRST <= LAST < 4294967294" % (value,))
    if any(first <= r <= last for r in _RESERVED):
        raise SandboxSpecError("uid_range %r contains a reserved uid (0, 65534 nobody, -1, -2)" % (value,))
    return first, last


def passwd_uids(first: int, last: int) -> Set[int]:
    """uids in [first, last] that /etc/passwd (or NSS) names: never handed to a sandbox."""
    try:
        return {p.pw_uid for p in pwd.getpwall() if first <= p.pw_uid <= last}
    except Exception:
        return set()


class UidAllocator(SlotAllocator):
    name, what, exhausted = "uids", "uids", UidsExhausted

    def __init__(self, first: int, last: int, state_dir: Optional[os.PathLike] = None) -> None:
        sd = Path(state_dir or STATE_DIR)
        made = not sd.exists()
        super().__init__(sd, first, last)
        if made:
            os.chmod(sd, 0o700)
        self._taken = passwd_uids(first, last)

    def _usable(self, n: int) -> bool:
        return n not in self._taken

    def allocate(self, owner: str, path: os.PathLike) -> int:
        """A uid of its own for sandbox ``owner``, held while its dir ``path`` exists."""
        return int(self._reserve({"owner": owner, "path": str(path), "ts": time.time()}))

    def release(self, uid: Optional[int], owner: Optional[str] = None) -> bool:
        return self._free(None if uid is None else str(int(uid)), owner)
