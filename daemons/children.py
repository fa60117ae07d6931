"""Child processes tied to the process that starts them.

``die_with_parent`` is the one ``prctl(PR_SET_PDEATHSIG, SIGTERM)`` of the project: the
supervisor's daemons, the demo's ``rolloutd up``, the math grader's workers, the example trainer's
daemons and the benchmarks' helpers all get SIGTERM when their parent dies, so a parent killed
with SIGKILL (whose ``finally`` never runs) leaves nothing running.
"""
from __future__ import annotations

import ctypes
import signal

PR_SET_PDEATHSIG = 1

# libc is loaded here, in the parent: a ``preexec_fn`` runs between fork and exec, where a
# dlopen could wait forever on a loader lock another of the parent's threads held at the fork.
try:
    _LIBC = ctypes.CDLL("libc.so.6", use_errno=True)
except OSError:  # not glibc Linux: children simply outlive their parent, as without this
    _LIBC = None


def die_with_parent() -> None:
    """In a child (a ``preexec_fn``, or a pool worker's initializer): SIGTERM when the thread
    that started it dies."""
    if _LIBC is not None:
        _LIBC.prctl(PR_SET_PDEATHSIG, signal.SIGTERM)
