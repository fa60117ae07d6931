"""Apptainer/Singularity .sif images from Jinja2 definition templates, with a build cache.

Cache modes:
  scratch    always rebuild (serialized, so concurrent builders do not clobber each other)
  versioned  reuse while the base image reference and the rolloutd version are unchanged
             (for a localimage base: its path, size and mtime). A moving docker tag such as
             ":latest" is not re-resolved: pin by digest, or bump the version.
  lock       reuse while the sha256 of a lockfile (requirements.lock, uv.lock...) is unchanged
Concurrent builds of one image name are serialized across processes with an flock on
<cache_dir>/.<name>.lock; whoever waited re-checks the cache and reuses the fresh build.
The builder is a plain function (definition path, output path) -> None, so tests and other
build backends plug in without a fake binary.
"""
from __future__ import annotations

import contextlib
import enum
import fcntl
import hashlib
import json
import os
import shlex
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Callable, Dict, Iterator, List, Optional, Tuple

import jinja2

from .errors import SandboxError, SandboxSpecError
from .log import log

TEMPLATE_DIR = Path(__file__).resolve().parent / "templates"
DEFAULT_TEMPLATE = "apptainer.def.j2"
Builder = Callable[[Path, Path], None]


class CacheMode(str, enum.Enum):
    SCRATCH = "scratch"
    VERSIONED = "versioned"
    LOCK = "lock"


class ImageBuildError(SandboxError):
    pass


@dataclass
class ImageSpec:
    name: str
    base: str                                   # docker ref ("python:3.11-slim") or a local .sif path
    bootstrap: str = "docker"                   # "docker" | "localimage"
    post: List[str] = field(default_factory=list)
    environment: Dict[str, str] = field(default_factory=dict)
    files: List[Tuple[str, str]] = field(default_factory=list)
    labels: Dict[str, str] = field(default_factory=dict)
    lockfile: Optional[str] = None              # required for CacheMode.LOCK

    def validate(self) -> "ImageSpec":
        if not self.name or not all(c.isalnum() or c in "-_." for c in self.name):
            raise SandboxSpecError("image name %r must be non-empty [A-Za-z0-9._-]" % self.name)
        if self.bootstrap not in ("docker", "localimage"):
            raise SandboxSpecError("bootstrap must be 'docker' or 'localimage', got %r" % self.bootstrap)
        if not self.base or "\n" in self.base:
            raise SandboxSpecError("base must be a single-line image reference")
        if self.bootstrap == "localimage" and not os.path.isabs(self.base):
            raise SandboxSpecError("a localimage base must be an absolute path")
        return self


def rolloutd_version() -> str:
    try:
        from importlib.metadata import PackageNotFoundError, version
        try:
            return version("rolloutd")
        except PackageNotFoundError:
            pass
    except ImportError:  # pragma: no cover
        pass
    return "0+unknown"


def _env() -> jinja2.Environment:
    env = jinja2.Environment(loader=jinja2.FileSystemLoader(str(TEMPLATE_DIR)), undefined=jinja2.StrictUndefined,
                             keep_trailing_newline=True, autoescape=False)
    env.filters["shquote"] = shlex.quote
    return env


def render_definition(spec: ImageSpec, *, cache_mode: str = "scratch", cache_key: str = "none",
                      version: Optional[str] = None, template: str = DEFAULT_TEMPLATE) -> str:
    spec.validate()
    return _env().get_template(template).render(
        name=spec.name, bootstrap=spec.bootstrap, base=spec.base, post=spec.post, environment=spec.environment,
        files=spec.files, labels=spec.labels, rolloutd_version=version or rolloutd_version(),
        cache_mode=cache_mode, cache_key=cache_key,
    )


def build_argv(binary: str, definition: Path, output: Path, fakeroot: bool = False) -> List[str]:
    """`apptainer build` command line (pure)."""
    argv = [binary, "build"]
    if fakeroot:
        argv.append("--fakeroot")
    return argv + [str(output), str(definition)]


def apptainer_builder(binary: str = "apptainer", fakeroot: bool = False) -> Builder:
    """The real builder: runs `apptainer build` through spython's command runner."""
    def build(definition: Path, output: Path) -> None:
        from spython.utils import run_command

        argv = build_argv(binary, definition, output, fakeroot)
        res = run_command(argv, quiet=True)
        if res["return_code"] != 0:
            raise ImageBuildError("%s failed (exit %s): %s" % (" ".join(argv), res["return_code"],
                                                              "".join(res["message"])[-2000:]))
    return build


class ImageBuilder:
    def __init__(self, cache_dir: os.PathLike, mode: str = "versioned", builder: Optional[Builder] = None,
                 binary: str = "apptainer", fakeroot: bool = False, version: Optional[str] = None) -> None:
        self.cache_dir = Path(cache_dir)
        self.cache_dir.mkdir(parents=True, exist_ok=True)
        try:
            self.mode = CacheMode(mode)
        except ValueError:
            raise SandboxSpecError("cache mode must be one of scratch, versioned, lock; got %r" % mode) from None
        self.builder = builder or apptainer_builder(binary, fakeroot)
        self.version = version or rolloutd_version()

    def cache_key(self, spec: ImageSpec) -> str:
        if self.mode is CacheMode.SCRATCH:
            return "scratch"
        h = hashlib.sha256()
        if self.mode is CacheMode.VERSIONED:
            h.update(("%s\0%s\0%s\0" % (spec.bootstrap, spec.base, self.version)).encode())
            if spec.bootstrap == "localimage":
                try:
                    st = os.stat(spec.base)
                    h.update(("%d\0%d" % (st.st_size, st.st_mtime_ns)).encode())
                except OSError:
                    raise SandboxSpecError("localimage base %s does not exist" % spec.base) from None
        else:
            if not spec.lockfile:
                raise SandboxSpecError("cache mode 'lock' needs ImageSpec.lockfile")
            try:
                h.update(Path(spec.lockfile).read_bytes())
            except OSError as e:
                raise SandboxSpecError("cannot read lockfile %s: %s" % (spec.lockfile, e)) from None
        return h.hexdigest()[:16]

    def path_for(self, spec: ImageSpec) -> Path:
        key = self.cache_key(spec)
        return self.cache_dir / ("%s.sif" % spec.name if key == "scratch" else "%s-%s.sif" % (spec.name, key))

    @contextlib.contextmanager
    def _lock(self, name: str) -> Iterator[None]:
        fd = os.open(self.cache_dir / (".%s.lock" % name), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o644)
        try:
            t0 = time.monotonic()
            fcntl.flock(fd, fcntl.LOCK_EX)
            waited = time.monotonic() - t0
            if waited > 0.05:
                log.info("image_build_lock_waited", image=name, duration_ms=round(waited * 1000, 1))
            yield
        finally:
            os.close(fd)

    def ensure(self, spec: ImageSpec) -> Path:
        """Path of a .sif for spec, built (once, serialized) unless the cache has it."""
        spec.validate()
        key = self.cache_key(spec)
        out = self.path_for(spec)
        with self._lock(spec.name):
            if self.mode is not CacheMode.SCRATCH and out.exists():
                log.info("image_cache_hit", image=spec.name, path=str(out), cache_mode=self.mode.value)
                return out
            definition = out.with_suffix(".def")
            definition.write_text(render_definition(spec, cache_mode=self.mode.value, cache_key=key,
                                                    version=self.version))
            tmp = out.with_name(".%s.%d.tmp.sif" % (out.stem, os.getpid()))
            t0 = time.monotonic()
            try:
                self.builder(definition, tmp)
                if not tmp.exists():
                    raise ImageBuildError("builder returned without producing %s" % tmp)
                os.replace(tmp, out)  # atomic: running sandboxes keep the old inode
            except BaseException:
                with contextlib.suppress(OSError):
                    tmp.unlink()
                raise
            meta = {"image": spec.name, "cache_mode": self.mode.value, "cache_key": key, "base": spec.base,
                    "bootstrap": spec.bootstrap, "rolloutd_version": self.version, "built_at": time.time(),
                    "lockfile": spec.lockfile}
            out.with_suffix(".json").write_text(json.dumps(meta, indent=1))
            log.info("image_built", image=spec.name, path=str(out), cache_mode=self.mode.value,
                     duration_ms=round((time.monotonic() - t0) * 1000, 1))
            return out
