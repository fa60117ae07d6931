"""The read-only library dir mounted into every sandbox: the tool server + ptyprocess.

Copied (not bind-mounted from the source tree) so that: the sandbox user can read it even
when the checkout or venv sits under a private home; a running sandbox never sees a
half-edited checkout; and paths are short and fixed. The copy is content-addressed and
made atomically, so concurrent daemons share it safely.
"""
from __future__ import annotations

import compileall
import hashlib
import importlib.util
import os
import shutil
import tempfile
from pathlib import Path
from typing import Dict, List, Tuple

PACKAGE_NAME = "rolloutd_toolserver"
_SRC = Path(__file__).resolve().parent / "toolserver"
_cache: Dict[str, Path] = {}


def _sources() -> List[Tuple[Path, str]]:
    files = [(p, "%s/%s" % (PACKAGE_NAME, p.name)) for p in sorted(_SRC.glob("*.py"))]
    spec = importlib.util.find_spec("ptyprocess")
    if spec is None or not spec.origin:
        raise RuntimeError("ptyprocess is not installed; the tool server needs it")
    pty_dir = Path(spec.origin).parent
    files += [(p, "ptyprocess/%s" % p.name) for p in sorted(pty_dir.glob("*.py"))]
    return files


def prepare(root_dir: os.PathLike) -> Path:
    """Return root_dir/lib/<hash>, creating it if needed. Holds rolloutd_toolserver/ and ptyprocess/."""
    key = str(root_dir)
    if key in _cache and _cache[key].is_dir():
        return _cache[key]
    files = _sources()
    h = hashlib.sha256()
    for src, rel in files:
        h.update(rel.encode() + b"\0" + src.read_bytes() + b"\0")
    lib_root = Path(root_dir) / "lib"
    lib_root.mkdir(parents=True, exist_ok=True)
    os.chmod(lib_root, 0o755)
    dest = lib_root / h.hexdigest()[:16]
    if not dest.is_dir():
        tmp = Path(tempfile.mkdtemp(prefix=".tmp-", dir=lib_root))
        for src, rel in files:
            (tmp / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, tmp / rel)
        compileall.compile_dir(str(tmp), quiet=1)  # used when the sandbox python matches ours
        for dirpath, dirnames, filenames in os.walk(tmp):
            os.chmod(dirpath, 0o755)
            for name in filenames:
                os.chmod(os.path.join(dirpath, name), 0o644)
        try:
            os.rename(tmp, dest)
        except OSError:  # another process won the race; theirs is identical
            shutil.rmtree(tmp, ignore_errors=True)
    _cache[key] = dest
    return dest
