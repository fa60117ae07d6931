"""Wire codec: msgpack header frame plus one raw frame per large numpy array.

A message is ``[header, buf0, buf1, ...]``. An array of more than ``INLINE_MAX_BYTES`` is
replaced by a msgpack ext (code 1) holding ``[frame_index, dtype, shape]``; its bytes travel
as a separate frame, sent and received without copies. A smaller one travels inside the
header as ext 2 ``[dtype, shape, bytes]``: each frame costs ~3 us to send and again to
receive, a copy of a few KiB far less, and a poll reply of 256 results was 1,025 frames
(bench/bench_pipeline.py). Python lists of token ids never appear on the wire.
"""
from __future__ import annotations

import gc
import math
import threading
from typing import Any, Sequence

import msgpack
import numpy as np

ARRAY_EXT = 1
INLINE_EXT = 2
# At most this many bytes an array travels inside the header (4,096 int32 token ids).
INLINE_MAX_BYTES = 16384
# Only plain numeric dtypes cross the wire; object arrays would be a code-execution door.
ALLOWED_DTYPES = frozenset({"<i4", "<i8", "<f4", "<f8", "|u1", "|i1", "|b1", "<u4", "<i2", "<f2"})


class CodecError(ValueError):
    """A frame set that does not decode. ``code`` is the wire error code."""

    code = "malformed"


class TooManyValues(CodecError):
    """A header holding more values than the decoder was allowed to build (``decode(max_values=)``)."""

    code = "too_large"


# What a list or map costs the decoder beside its entries, in numbers' worth: building an empty
# one (and the hook that counts it) takes ~8x as long as a small int (bench/bench_gateway_requests.py).
CONTAINER_VALUES = 8


_local = threading.local()


def _desc_packer() -> msgpack.Packer:
    # msgpack.packb called inside a packb ``default`` allocates a second 1 MiB buffer each time
    # (~20 us of page faults per array); one reusable Packer per thread packs it in well under 1 us.
    p = getattr(_local, "packer", None)
    if p is None:
        p = _local.packer = msgpack.Packer(use_bin_type=True)
    return p


# An empty 1-D array of each dtype, packed once: a job carries its trajectory's four (empty until
# the run phase fills them) through every hop, and building each one's ext in a Python hook cost
# ~1.6 us to encode and as much to decode (bench/bench_pipeline.py, overhead).
_EMPTY_EXT = {dt: msgpack.ExtType(INLINE_EXT, msgpack.packb([dt, [0], b""], use_bin_type=True)) for dt in ALLOWED_DTYPES}
_EMPTY_DTYPE = {ext.data: np.dtype(dt) for dt, ext in _EMPTY_EXT.items()}


def encode(obj: dict, inline_max: int | None = INLINE_MAX_BYTES) -> list:
    """``inline_max``: arrays of at most this many bytes go inside the header (ext 2); None: every
    array in a frame of its own (ext 1 only, what a client that did not ask for ext 2 reads)."""
    buffers: list = []
    inline = -1 if inline_max is None else inline_max

    def default(o: Any):
        if isinstance(o, np.ndarray):
            dt = o.dtype.str
            if dt not in ALLOWED_DTYPES:
                if o.dtype.byteorder == ">":
                    o = o.astype(o.dtype.newbyteorder("<"))
                    dt = o.dtype.str
                if dt not in ALLOWED_DTYPES:
                    raise TypeError(f"array dtype {dt} cannot be sent")
            if inline >= 0 and not o.size and o.ndim == 1:
                return _EMPTY_EXT[dt]
            o = np.ascontiguousarray(o)
            if o.nbytes <= inline:
                return msgpack.ExtType(INLINE_EXT, _desc_packer().pack([dt, list(o.shape), o.tobytes()]))
            buffers.append(o.data.cast("B") if o.nbytes else b"")  # byte-format view: len() is bytes
            return msgpack.ExtType(ARRAY_EXT, _desc_packer().pack([len(buffers), dt, list(o.shape)]))
        if isinstance(o, np.generic):
            return o.item()
        if isinstance(o, (set, frozenset, tuple)):
            return list(o)
        raise TypeError(f"cannot encode {type(o).__name__}")

    header = msgpack.packb(obj, default=default, use_bin_type=True)
    return [header, *buffers]


def count_values(obj: Any) -> int:
    """What ``decode(max_values=)`` counts for ``obj`` once encoded (a client splits its requests
    by it): each list, map or array ``CONTAINER_VALUES`` plus its entries (two per map entry)."""
    n, stack = 0, [obj]
    while stack:
        v = stack.pop()
        if isinstance(v, dict):
            n += CONTAINER_VALUES + 2 * len(v)
            stack.extend(x for x in v.values() if isinstance(x, (dict, list, tuple, np.ndarray)))
        elif isinstance(v, (list, tuple)):
            n += CONTAINER_VALUES + len(v)
            stack.extend(x for x in v if isinstance(x, (dict, list, tuple, np.ndarray)))
        elif isinstance(v, np.ndarray):
            n += CONTAINER_VALUES
    return n


def encode_with(obj: dict, key: str, encoded: list) -> list:
    """``encode(dict(obj, key=value))`` where ``encoded`` is ``encode(value)``, made once: a value
    many messages carry (a task's instance, sent once per sample) is packed once, not per message.
    ``obj`` itself holds no arrays (``encoded``'s array frames keep their numbers)."""
    head = msgpack.packb(obj, use_bin_type=True, default=_plain_default)
    n = len(obj)
    skip = 1 if n < 16 else 3 if n < 1 << 16 else 5  # fixmap, map 16, map 32 header
    p = _desc_packer()
    return [p.pack_map_header(n + 1) + head[skip:] + p.pack(key) + bytes(_buffer(encoded[0])), *encoded[1:]]


def decode_forwarded(frames: Sequence) -> dict:
    """``decode`` for a message the receiver passes on (the gateway's results): a one-frame
    message's inline arrays stay msgpack ``ExtType`` objects, which ``encode`` packs again as
    they are. Building each as numpy (a Python hook call) and packing it back (another) was
    two-thirds of a result's cost in the gateway (bench/bench_pipeline.py). Their descriptors
    are not checked here: the sender's ``encode`` made them, and the receiver of the forwarded
    message checks them as it decodes. Raises CodecError, never anything else."""
    if len(frames) != 1:  # arrays in frames: their indices change when forwarded, so build them
        return decode(frames)
    try:
        obj = msgpack.unpackb(_buffer(frames[0]), raw=False, strict_map_key=True,
                              max_array_len=1 << 20, max_map_len=1 << 20)
    except Exception as e:  # noqa: BLE001 - msgpack raises many types on garbage
        raise CodecError(f"header is not msgpack: {type(e).__name__}: {e}") from None
    if not isinstance(obj, dict):
        raise CodecError("header is not a map")
    return obj


def build_arrays(obj: Any) -> Any:
    """``obj`` with the ``ExtType`` arrays ``decode_forwarded`` left made numpy (for a receiver
    that wants every array in a frame of its own)."""
    return decode(encode(obj)) if isinstance(obj, dict) else obj


def decode(frames: Sequence, max_values: int | None = None) -> dict:
    """Decode frames (bytes, memoryview or zmq.Frame). Raises CodecError, never anything else.

    ``max_values`` bounds the work of decoding an untrusted header, whose bytes alone do not: 15 MiB
    of empty lists are 15 million objects (seconds and gigabytes to build). Every list, map or array
    counts ``CONTAINER_VALUES`` plus one per entry (two per map entry) and decoding stops with
    ``TooManyValues`` once the sum passes ``max_values``; no list or map may hold more entries than
    that either (refused from its header, before anything in it is built). The cyclic collector is
    off meanwhile (it walked the growing containers again and again: 1M empty lists took 1.7 s
    with it, 0.1 s without)."""
    if not frames:
        raise CodecError("empty message")
    bufs = [_buffer(f) for f in frames]
    left = max_values

    def count(obj):  # list_hook / object_hook: called once each list or map is complete
        nonlocal left
        left -= CONTAINER_VALUES + (len(obj) if obj.__class__ is list else 2 * len(obj))
        if left < 0:
            raise TooManyValues(f"the request holds more than {max_values} values (each list or map counts "
                                f"{CONTAINER_VALUES} plus its entries)")
        return obj

    def ext_hook(code: int, data: bytes):
        if max_values is not None:
            count(())
        if code not in (ARRAY_EXT, INLINE_EXT):
            raise CodecError(f"unknown msgpack ext type {code}")
        if code == INLINE_EXT:
            empty = _EMPTY_DTYPE.get(data)
            if empty is not None:
                return np.empty(0, empty)
        try:
            desc = msgpack.unpackb(data)
            if code == ARRAY_EXT:
                idx, dt, shape = desc
            else:
                dt, shape, buf = desc
        except Exception as e:  # noqa: BLE001 - any decoding failure is malformed input
            raise CodecError(f"bad array descriptor: {e}") from None
        if code == ARRAY_EXT:
            if not isinstance(idx, int) or not 1 <= idx < len(bufs):
                raise CodecError(f"array frame {idx!r} missing")
            buf, where = bufs[idx], f"array frame {idx}"
        elif not isinstance(buf, bytes):
            raise CodecError(f"inline array bytes must be binary, got {type(buf).__name__}")
        else:  # writable, as a received frame is: the arrays of one message behave alike
            buf, where = bytearray(buf), "inline array"
        if dt not in ALLOWED_DTYPES:
            raise CodecError(f"array dtype {dt!r} not allowed")
        if not isinstance(shape, list) or not all(isinstance(s, int) and s >= 0 for s in shape):
            raise CodecError("bad array shape")
        dtype = np.dtype(dt)
        n = math.prod(shape)  # np.prod costs ~4 us on a short list
        if n * dtype.itemsize != len(buf):
            raise CodecError(f"{where} has {len(buf)} bytes, shape {shape} of {dt} needs {n * dtype.itemsize}")
        return np.frombuffer(buf, dtype=dtype).reshape(shape) if n else np.zeros(shape, dtype=dtype)

    limits = dict(max_array_len=1 << 20, max_map_len=1 << 20)
    if max_values is not None:
        limits = dict(max_array_len=max_values, max_map_len=max_values, list_hook=count, object_hook=count)
    collecting = max_values is not None and gc.isenabled()
    if collecting:
        gc.disable()
    try:
        obj = msgpack.unpackb(bufs[0], ext_hook=ext_hook, raw=False, strict_map_key=True, **limits)
    except CodecError:
        raise
    except ValueError as e:
        if "for map key" in str(e):  # valid msgpack, a key of the wrong type: name where it is
            raise _key_error(bufs[0]) from None
        if max_values is not None and "exceeds max_" in str(e):  # "1000000 exceeds max_array_len(524288)"
            raise TooManyValues(f"the request holds a list or map of {str(e).split()[0]} entries; at most "
                                f"{max_values} values per request") from None
        raise CodecError(f"header is not msgpack: {type(e).__name__}: {e}") from None
    except Exception as e:  # noqa: BLE001 - msgpack raises many types on garbage
        raise CodecError(f"header is not msgpack: {type(e).__name__}: {e}") from None
    finally:
        if collecting:
            gc.enable()
    if not isinstance(obj, dict):
        raise CodecError("header is not a map")
    return obj


class _Pairs(list):
    """A map decoded as its (key, value) pairs: keys of any type, hashable or not."""


def _pairs(head) -> Any:
    return msgpack.unpackb(head, ext_hook=lambda code, data: None, raw=False, strict_map_key=False,
                           object_pairs_hook=_Pairs, max_array_len=1 << 20, max_map_len=1 << 20)


def _key_error(head) -> CodecError:
    """``invalid`` naming the first map whose key is not a string (``submit.tasks[0].instance``)."""
    try:
        root = _pairs(head)
    except Exception:  # noqa: BLE001
        return CodecError("header is not msgpack")
    kind = next((v for k, v in root if k == "kind"), None) if isinstance(root, _Pairs) else None
    stack = [(root, kind if isinstance(kind, str) else "header")]
    while stack:
        v, path = stack.pop()
        if isinstance(v, _Pairs):
            for k, x in v:  # keys first, in order: the message names the first bad one
                if not isinstance(k, (str, bytes)):
                    what = {bool: "a bool", int: "an int", float: "a number", type(None): "null",
                            list: "a list", tuple: "a list", _Pairs: "a map"}.get(type(k), type(k).__name__)
                    e = CodecError(f"{path}: map keys must be strings, got {what} key {_short(k)}")
                    e.code = "invalid"
                    return e
            stack.extend(reversed([(x, f"{path}.{k}" if isinstance(k, str) else path) for k, x in v]))
        elif isinstance(v, list):
            stack.extend(reversed([(x, f"{path}[{i}]") for i, x in enumerate(v)]))
    return CodecError("header is not msgpack")


def _short(k) -> str:
    r = repr(list(k) if isinstance(k, (tuple, _Pairs)) else k)
    return r if len(r) <= 40 else r[:37] + "..."


def peek_req_id(frames: Sequence, limit: int = 1 << 16) -> int:
    """The ``req_id`` of a request too large (or too broken) to decode, so the error reply can
    still name it; 0 when it cannot be read cheaply. Keys of any type are read (a request refused
    for a non-string key deep inside still gets its req_id). A header over ``limit`` bytes is
    read only up to its first list or map (the shipped client sends ``req_id`` third)."""
    try:
        head = _buffer(frames[0])
        if len(head) > limit:
            return _leading_req_id(head)
        root = _pairs(head)
        if not isinstance(root, _Pairs):
            return 0
        rid = next((v for k, v in root if k == "req_id"), 0)
        return rid if isinstance(rid, int) and not isinstance(rid, bool) else 0
    except Exception:  # noqa: BLE001 - best effort only
        return 0


def _leading_req_id(head) -> int:
    """``req_id`` among the scalar entries that open a large header's root map; 0 if a list or
    map (or a non-string key) comes first."""
    u = msgpack.Unpacker(raw=False, max_buffer_size=len(head))
    u.feed(head)
    for _ in range(min(u.read_map_header(), 16)):
        for want_key in (True, False):
            b = head[u.tell()]
            if not (b <= 0x7f or 0xa0 <= b <= 0xbf or 0xc0 <= b <= 0xc3 or 0xca <= b <= 0xd3 or 0xd9 <= b <= 0xdb
                    or b >= 0xe0) or (want_key and not (0xa0 <= b <= 0xbf or 0xd9 <= b <= 0xdb)):
                return 0  # a container, bin or ext (or a key that is not a string): stop here
            v = u.unpack()
            if want_key:
                key = v
            elif key == "req_id":
                return v if v.__class__ is int else 0
    return 0


def _buffer(f) -> memoryview | bytes:
    if isinstance(f, bytes):
        return f
    if isinstance(f, (bytearray, memoryview)):
        m = memoryview(f)
        return m if m.format == "B" and m.ndim == 1 else m.cast("B")
    buf = getattr(f, "buffer", None)  # zmq.Frame: zero-copy view
    if buf is not None:
        return buf
    raise CodecError(f"frame of type {type(f).__name__}")


def frames_size(frames: Sequence) -> int:
    return sum(len(_buffer(f)) for f in frames)


def pack(obj: Any) -> bytes:
    """Plain msgpack for small payloads with no arrays (event bodies)."""
    return msgpack.packb(obj, use_bin_type=True, default=_plain_default)


def unpack(data: bytes) -> Any:
    try:
        return msgpack.unpackb(data, raw=False)
    except Exception as e:  # noqa: BLE001
        raise CodecError(f"not msgpack: {e}") from None


def _plain_default(o: Any):
    if isinstance(o, np.generic):
        return o.item()
    if isinstance(o, np.ndarray):
        return o.tolist()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    return str(o)
