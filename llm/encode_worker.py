"""Long texts are tokenized in a small pool of worker processes, bounded in tokens, CPU and memory.

Why a process: the Hugging Face tokenizer's memory for one encode is ~140 bytes per character
(offsets, alignments, pieces: 8 MB of text peaked at +1.1 GB), and the allocator keeps most of it
when the encode returns (measured: +575 MB still held by the run daemon; issue 38 saw 1.3 GB per
request held when idle). In a worker process that memory is bounded (``RLIMIT_AS``) and given back
by recycling the worker; the run daemon only holds the text and the ids (int32 over a pipe).

Why chunks: a text that cannot fit the context window is refused after ``max_tokens`` ids, not
after all of them. The worker encodes the text in pieces of ~64 KiB cut at points where the
tokenizer's own pre-tokenization splits anyway (after a newline before a non-space, before a
space that follows a letter or digit and precedes a letter): the ids are the same as the whole
text's, which each worker checks per tokenizer on a probe corpus before it cuts anything
(a tokenizer that fails the probe, e.g. a SentencePiece ``Metaspace`` that prepends to each piece,
is encoded whole, bounded by CPU only). A request's CPU is bounded by ``RLIMIT_CPU`` per task: an
unsplittable run (8 MB of spaces) ends the worker at the cap instead of costing seconds.

Workers run at ``nice`` 10, so the daemon's loop and threads win the cores over them.

Interface (blocking; endpoint threads call it)::

    ids = encode(backend_tokenizer, key, text, plain=False, special=False, max_tokens=None, cpu_s=10.0)
        -> np.ndarray[int32]; raises EncodeRefused(kind="tokens"|"cpu"|"memory", ...)
    ENCODE_STATS.cpu_s  # thread-local: worker CPU spent for this thread's calls (the job's budget)
"""
from __future__ import annotations

import json
import os
import queue
import re
import resource
import select
import struct
import subprocess
import sys
import threading
import time
from typing import Any

import numpy as np
import structlog

log = structlog.get_logger("rolloutd.llm")

WORKERS = 2  # per process: long texts are rare; one job has at most one in a worker at a time
AS_MB = 3072  # each worker's address space (RLIMIT_AS): tokenizer + the chunk being encoded
RECYCLE_MB = 768  # a worker whose RSS grew past this after a task is replaced (memory given back)
IDLE_S = 300.0  # a worker unused this long exits (it holds its tokenizers: ~330 MB for Qwen2.5)
CHUNK = 64 * 1024  # characters per piece of a chunked encode
NICE = 10
_HDR = struct.Struct("<II")  # header length, payload length


class EncodeRefused(Exception):
    """The text was not (fully) encoded: ``kind`` is ``tokens`` (more than ``max_tokens``; ``count``
    ids seen so far), ``cpu`` (past its CPU bound) or ``memory`` (past the worker's address space)."""

    def __init__(self, kind: str, message: str, count: int = 0) -> None:
        super().__init__(message)
        self.kind = kind
        self.count = count


class _Stats(threading.local):
    cpu_s = 0.0


ENCODE_STATS = _Stats()


# -- the worker side ---------------------------------------------------------------------------
# Cut points: after a newline before a non-space, or a space between a letter/digit and a letter.
_CUT = re.compile(r"(?<=\n)(?=\S)|(?<=[^\W_]) (?=[^\W\d_])")
_PROBE = ("def f(x):\n    return x + 1\n\nclass A:\n  pass\n" * 3
          + "Hello world, this is a test. Ünïcödé wörds ånd 数字 123 456 done\n"
          + "  leading spaces\n\n\ntrailing  \n\tTabs\there word's can't I'm\n"
          + "x=1;y = 2 foo-bar foo_bar CamelCase 3.14e5 0x1F\n" * 2)


def _cuts(text: str, start: int, chunk: int) -> int:
    """The end of the piece that starts at ``start``: the last cut point in its second half, else
    the first one after it, else the end of the text."""
    end = start + chunk
    if end >= len(text):
        return len(text)
    last = None
    for m in _CUT.finditer(text, start + chunk // 2, end):
        last = m.start()
    if last is not None:
        return last
    m = _CUT.search(text, end)
    return m.start() if m is not None else len(text)


def _pieces(text: str, chunk: int):
    start = 0
    while start < len(text):
        end = _cuts(text, start, chunk)
        yield text[start:end]
        start = end


class _Tok:
    """One tokenizer in a worker: the full one, the plain one (no added tokens) and whether
    chunked encoding gives the whole text's ids for it."""

    def __init__(self, spec: str) -> None:
        from tokenizers import Tokenizer

        self.full = Tokenizer.from_str(spec)
        added = [t.content for t in self.full.get_added_tokens_decoder().values()]
        d = json.loads(spec)
        d["added_tokens"], d["post_processor"] = [], None
        self.plain = Tokenizer.from_str(json.dumps(d))
        empty = self.full.encode("", add_special_tokens=True).ids
        one = self.full.encode("x", add_special_tokens=True).ids
        bare = self.full.encode("x", add_special_tokens=False).ids
        i = one.index(bare[0]) if bare and bare[0] in one else len(empty)
        self.special = (one[:i], one[i + len(bare):])  # what the post-processor puts around a text
        probe = _PROBE + " ".join(added) + "\n" + _PROBE
        self.chunked = {}
        for name, t in (("full", self.full), ("plain", self.plain)):
            ok = all(sum((t.encode(p, add_special_tokens=False).ids for p in _pieces(probe, c)), [])
                     == t.encode(probe, add_special_tokens=False).ids for c in (7, 16, 40))
            if name == "full" and any(_CUT.search(a) for a in added):
                ok = False  # a cut could fall inside an added token
            self.chunked[name] = ok


def _rss_mb() -> int:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") >> 20


def _read_exact(f, n: int) -> bytes:
    buf = f.read(n)
    if buf is None or len(buf) != n:
        raise EOFError
    return buf


def _send(f, head: dict, payload: bytes = b"") -> None:
    h = json.dumps(head).encode()
    f.write(_HDR.pack(len(h), len(payload)) + h)
    f.write(payload)
    f.flush()


def _encode(tok: _Tok, text: str, plain: bool, special: bool, max_tokens: int | None, cpu_end: float) -> np.ndarray:
    t = tok.plain if plain else tok.full
    chunked = tok.chunked["plain" if plain else "full"]
    parts: list[np.ndarray] = []
    n = 0
    for piece in (_pieces(text, CHUNK) if chunked else (text,)):
        ids = np.asarray(t.encode(piece, add_special_tokens=False).ids, dtype=np.int32)
        parts.append(ids)
        n += len(ids)
        if max_tokens is not None and n > max_tokens:
            raise EncodeRefused("tokens", f"more than {max_tokens} tokens", n)
        if time.process_time() > cpu_end:
            raise EncodeRefused("cpu", "past its CPU bound", n)
    if special and not plain:
        pre, post = tok.special
        parts = [np.asarray(pre, np.int32)] + parts + [np.asarray(post, np.int32)]
    return np.concatenate(parts) if parts else np.zeros(0, np.int32)


def worker_main() -> None:
    """The worker's loop: ``load`` a tokenizer (its JSON), ``encode`` texts; until stdin closes."""
    as_mb, nice = int(sys.argv[1]), int(sys.argv[2])
    resource.setrlimit(resource.RLIMIT_AS, (as_mb << 20, as_mb << 20))
    fin, fout = sys.stdin.buffer, sys.stdout.buffer
    toks: dict[str, _Tok] = {}
    while True:
        try:
            hl, pl = _HDR.unpack(_read_exact(fin, _HDR.size))
            head = json.loads(_read_exact(fin, hl))
            payload = _read_exact(fin, pl)
        except EOFError:
            return
        try:
            if head["op"] == "load":
                toks[head["key"]] = _Tok(payload.decode())
                _send(fout, {"ok": True, "rss_mb": _rss_mb()})
                continue
            tok = toks[head["key"]]
            if nice:  # loads run at the daemon's priority (a job waits for them), encodes below it
                os.nice(nice)
                nice = 0
            c0 = time.process_time()
            soft, hard = resource.getrlimit(resource.RLIMIT_CPU)
            # the hard stop for a piece that cannot be cut: SIGXCPU ends this worker
            resource.setrlimit(resource.RLIMIT_CPU, (int(c0 + head["cpu_s"]) + 2, hard))
            try:
                ids = _encode(tok, payload.decode("utf-8", "surrogatepass"), head["plain"], head["special"],
                              head["max_tokens"], c0 + head["cpu_s"])
            finally:
                resource.setrlimit(resource.RLIMIT_CPU, (soft, hard))
            _send(fout, {"ok": True, "cpu_s": time.process_time() - c0, "rss_mb": _rss_mb()}, ids.tobytes())
        except EncodeRefused as e:
            _send(fout, {"ok": False, "kind": e.kind, "count": e.count, "cpu_s": time.process_time() - c0,
                         "rss_mb": _rss_mb()})
        except MemoryError:
            _send(fout, {"ok": False, "kind": "memory", "count": 0, "cpu_s": 0.0, "rss_mb": 0, "recycle": True})
        except Exception as e:  # noqa: BLE001 - a bug: said to the caller, the worker replaced
            _send(fout, {"ok": False, "kind": "error", "message": f"{type(e).__name__}: {e}", "recycle": True})


# -- the daemon side ---------------------------------------------------------------------------
class _Worker:
    def __init__(self, as_mb: int, nice: int) -> None:
        env = dict(os.environ, MALLOC_ARENA_MAX="2", TOKENIZERS_PARALLELISM="false", RAYON_NUM_THREADS="1")
        self.proc = subprocess.Popen([sys.executable, "-m", "rolloutd.llm.encode_worker", str(as_mb), str(nice)],
                                     stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL,
                                     close_fds=True, env=env)
        self.loaded: set[str] = set()
        self.used = time.monotonic()

    def call(self, head: dict, payload: bytes, timeout_s: float) -> tuple[dict, bytes]:
        p = self.proc
        h = json.dumps(head).encode()
        p.stdin.write(_HDR.pack(len(h), len(payload)) + h)
        p.stdin.write(payload)
        p.stdin.flush()
        fd = p.stdout.fileno()
        deadline = time.monotonic() + timeout_s
        buf = bytearray()
        need = _HDR.size
        hl = pl = None
        while True:
            while len(buf) < need:
                left = deadline - time.monotonic()
                if left <= 0 or not select.select([fd], [], [], left)[0]:
                    raise TimeoutError(f"no answer from the encode worker in {timeout_s:.0f} s")
                d = os.read(fd, max(65536, need - len(buf)))
                if not d:
                    raise EOFError("the encode worker exited")
                buf += d
            if hl is None:
                hl, pl = _HDR.unpack_from(buf)
                need = _HDR.size + hl + pl
                continue
            return json.loads(bytes(buf[_HDR.size:_HDR.size + hl])), bytes(buf[_HDR.size + hl:need])

    def close(self) -> None:
        p = self.proc
        if p.poll() is None:
            p.kill()
        p.wait()
        for f in (p.stdin, p.stdout):
            try:
                f.close()
            except OSError:
                pass


class EncodePool:
    """``size`` worker processes, started on first use; a caller takes an idle one (waiting for
    one if all are busy), and a worker that died, timed out or grew is replaced."""

    def __init__(self, size: int = WORKERS, as_mb: int = AS_MB, nice: int = NICE, recycle_mb: int = RECYCLE_MB,
                 idle_s: float = IDLE_S):
        self.as_mb, self.nice, self.recycle_mb, self.idle_s = as_mb, nice, recycle_mb, idle_s
        self._reaper: threading.Thread | None = None
        self._idle: queue.LifoQueue[_Worker | None] = queue.LifoQueue()  # a started worker before a slot
        for _ in range(size):
            self._idle.put(None)  # a slot; its worker is started when first taken
        self._specs: dict[str, bytes] = {}

    def encode(self, backend: Any, key: str, text: str, *, plain: bool = False, special: bool = False,
               max_tokens: int | None = None, cpu_s: float = 10.0) -> np.ndarray:
        payload = text.encode("utf-8", "surrogatepass")
        w = self._idle.get()
        keep = False
        try:
            if w is None:
                w = _Worker(self.as_mb, self.nice)
                if self._reaper is None:
                    self._reaper = threading.Thread(target=self._reap, name="encode-reaper", daemon=True)
                    self._reaper.start()
            if key not in w.loaded:
                spec = self._specs.get(key)
                if spec is None:
                    spec = self._specs[key] = backend.to_str().encode()
                w.call({"op": "load", "key": key}, spec, 120.0)
                w.loaded.add(key)
            head = {"op": "encode", "key": key, "plain": plain, "special": special, "max_tokens": max_tokens,
                    "cpu_s": cpu_s}
            try:
                # the wall-clock backstop: a niced worker on a busy node gets a small share of a core
                r, out = w.call(head, payload, 6 * cpu_s + 60.0)
            except (EOFError, TimeoutError, OSError) as e:
                ENCODE_STATS.cpu_s += cpu_s  # ended at (or near) its bound: what it spent
                try:  # its pipe closes a moment before it can be waited for
                    code = w.proc.wait(5) if isinstance(e, EOFError) else w.proc.poll()
                except subprocess.TimeoutExpired:
                    code = None
                log.info("encode_worker_ended", error=str(e), exit_code=code, chars=len(text))
                # SIGXCPU (or the kernel's SIGKILL past the hard limit), or the backstop
                if isinstance(e, TimeoutError) or (code is not None and -code in (24, 9)):
                    raise EncodeRefused("cpu", f"tokenizing this text took more than {cpu_s:g} s of CPU") from None
                raise EncodeRefused("memory", "tokenizing this text needed more memory than a request may use "
                                              f"({self.as_mb} MB)") from None
            ENCODE_STATS.cpu_s += r.get("cpu_s", 0.0)
            keep = not r.get("recycle") and r.get("rss_mb", 0) <= self.recycle_mb
            if not r["ok"]:
                kind = r["kind"]
                if kind == "error":
                    raise RuntimeError(f"the encode worker failed: {r.get('message')}")
                msg = {"tokens": f"the text is more than {max_tokens} tokens", "cpu": "tokenizing this text took "
                       f"more than {cpu_s:g} s of CPU", "memory": "tokenizing this text needed more memory than "
                       f"a request may use ({self.as_mb} MB)"}[kind]
                raise EncodeRefused(kind, msg, r.get("count", 0))
            return np.frombuffer(out, dtype=np.int32)
        finally:
            if w is not None and not keep:
                w.close()
                w = None
            if w is not None:
                w.used = time.monotonic()
            self._idle.put(w)

    def _take_idle(self) -> list:
        out = []
        while True:
            try:
                out.append(self._idle.get_nowait())
            except queue.Empty:
                return out

    def _reap(self) -> None:
        """End workers idle for ``idle_s``: their memory goes back to the node."""
        while True:
            time.sleep(min(30.0, self.idle_s / 2))
            now = time.monotonic()
            for w in reversed(self._take_idle()):  # put back in the same (LIFO) order
                if w is not None and now - w.used > self.idle_s:
                    w.close()
                    w = None
                self._idle.put(w)

    def close(self) -> None:
        for w in self._take_idle():
            if w is not None:
                w.close()
            self._idle.put(None)


_LIBC: Any = None
TRIM_BYTES = 1 << 20  # requests with a body at least this large give the memory back when done


def release_memory() -> None:
    """Give the allocator's free pages back to the OS (glibc ``malloc_trim``; elsewhere nothing).
    A large request's parse and render leave their memory free but held in the daemon's arenas
    (measured: three 8 MB requests at once, +165-205 MB held after them; after a trim, none).
    ~30 ms for a fragmented heap of 700 MB, the GIL released (ctypes): call it off the loop."""
    global _LIBC
    if _LIBC is None:
        import ctypes

        try:
            _LIBC = ctypes.CDLL("libc.so.6").malloc_trim
        except (OSError, AttributeError):
            _LIBC = False
    if _LIBC:
        _LIBC(0)


_POOL: EncodePool | None = None
_POOL_LOCK = threading.Lock()


def pool() -> EncodePool:
    """The process's pool (``WORKERS`` workers)."""
    global _POOL
    with _POOL_LOCK:
        if _POOL is None:
            _POOL = EncodePool()
        return _POOL


def encode(backend: Any, key: str, text: str, **kw) -> np.ndarray:
    """``text``'s ids from ``backend`` (a ``tokenizers.Tokenizer``; ``key`` names it) in a worker."""
    return pool().encode(backend, key, text, **kw)


if __name__ == "__main__":
    worker_main()
