"""The wire codec and the typed messages."""
from __future__ import annotations

import numpy as np
import pytest

from rolloutd.bus import codec
from rolloutd.bus.messages import Job, MessageError, Submit, from_wire


def test_arrays_travel_as_separate_frames_and_survive_reencoding():
    ids = np.arange(16, dtype=np.int32)
    lp = np.linspace(-1, 0, 16, dtype=np.float32)
    frames = codec.encode({"v": 1, "ids": ids, "nested": {"lp": lp, "empty": np.zeros(0, np.int8)}}, inline_max=None)
    assert len(frames) == 4 and len(frames[1]) == 64  # the header plus one raw frame per array
    out = codec.decode(frames)
    np.testing.assert_array_equal(out["ids"], ids)
    np.testing.assert_array_equal(out["nested"]["lp"], lp)
    # re-encoding decoded arrays (what the gateway does with results) keeps byte lengths right
    again = codec.decode(codec.encode(out))
    np.testing.assert_array_equal(again["ids"], ids)
    assert again["nested"]["empty"].shape == (0,)


def test_2d_and_big_endian_arrays():
    a = np.arange(6, dtype=">i4").reshape(2, 3)
    out = codec.decode(codec.encode({"a": a}))
    assert out["a"].dtype == np.dtype("<i4") and out["a"].tolist() == a.tolist()


@pytest.mark.parametrize("frames", [[], [b""], [b"\xc1"], [b"\x93\x01\x02\x03"]])
def test_garbage_raises_codec_error_only(frames):
    with pytest.raises(codec.CodecError):
        codec.decode(frames)


def test_object_arrays_cannot_be_sent():
    with pytest.raises(TypeError):
        codec.encode({"a": np.array([object()], dtype=object)})


def test_messages_validate_types_and_tolerate_unknown_fields():
    msg = from_wire({"v": 1, "kind": "submit", "client_id": "c", "tasks": [{"handler": "h", "instance": {}}],
                     "future_field": 1})
    assert isinstance(msg, Submit) and msg.tasks[0]["handler"] == "h"
    with pytest.raises(MessageError) as e:
        from_wire({"v": 1, "kind": "job", "job_id": "1", "attempt": 1, "handler": "h", "instance": {}})
    assert e.value.code == "invalid"
    with pytest.raises(MessageError) as e:
        from_wire({"v": 1, "kind": "job", "job_id": True, "attempt": 1, "handler": "h", "instance": {}})
    assert e.value.code == "invalid"  # bools are not ints on the wire
    job = Job(job_id=1, attempt=1, handler="h", instance={"x": np.ones(3, np.float32)})
    back = from_wire(codec.decode(codec.encode(job.to_wire())))
    assert back.instance["x"].tolist() == [1.0, 1.0, 1.0]


@pytest.mark.parametrize("obj", [{"a": [1, 2, {}], "b": np.arange(3)}, {"t": [{"m": [{"r": "u"}] * 5}] * 20},
                                 {"x": [[[]] * 10] * 10, "y": ()}])
def test_count_values_is_what_a_bounded_decode_counts(obj):
    """A client splits requests by ``count_values``; the gateway decodes with ``max_values``: the
    same count, so a request split to fit is never refused."""
    n = codec.count_values(obj)
    frames = codec.encode(obj)
    assert codec.decode(frames, max_values=n)
    with pytest.raises(codec.TooManyValues):
        codec.decode(frames, max_values=n - 1)


def test_a_list_longer_than_the_value_bound_is_refused_from_its_header():
    frames = codec.encode({"ids": list(range(100))})
    with pytest.raises(codec.TooManyValues) as e:
        codec.decode(frames, max_values=50)
    assert "100 entries" in str(e.value)


def test_encode_with_splices_a_value_packed_once():
    inst = {"a": [1, 2], "arr": np.arange(5)}
    for n in (3, 15, 16):  # fixmap, and the switch to map 16 when the key is added
        obj = {f"k{i}": i for i in range(n)}
        out = codec.decode(codec.encode_with(obj, "instance", codec.encode(inst)))
        assert out["instance"]["a"] == [1, 2] and out["instance"]["arr"].tolist() == list(range(5))
        assert all(out[f"k{i}"] == i for i in range(n))


def test_small_arrays_travel_inside_the_header_large_ones_in_frames():
    at = np.arange(codec.INLINE_MAX_BYTES // 4, dtype=np.int32)  # exactly the bound: inline
    over = np.arange(codec.INLINE_MAX_BYTES // 4 + 1, dtype=np.int32)
    obj = {"v": 1, "small": np.arange(5, dtype=np.float32), "at": at, "over": over, "empty": np.zeros((0, 3), np.int8)}
    frames = codec.encode(obj)
    assert len(frames) == 2 and len(frames[1]) == over.nbytes  # only the array over the bound has a frame
    out = codec.decode(frames)
    for k in ("small", "at", "over", "empty"):
        assert out[k].dtype == obj[k].dtype and out[k].shape == obj[k].shape and out[k].tolist() == obj[k].tolist()
    out["small"][0] = 7.0  # writable, as an array read from a received frame is
    assert codec.decode(codec.encode(out))["small"][0] == 7.0


@pytest.mark.parametrize("dt", sorted(codec.ALLOWED_DTYPES))
def test_an_empty_array_has_the_wire_bytes_of_any_other_and_decodes_to_its_own_array(dt):
    """Empty 1-D arrays (a trajectory's, until the run phase fills them) take a packed-once path:
    the same ext 2 bytes as every inline array, and a fresh writable array per decode."""
    import msgpack

    want = msgpack.packb({"a": msgpack.ExtType(codec.INLINE_EXT, msgpack.packb([dt, [0], b""], use_bin_type=True))},
                         use_bin_type=True)
    frames = codec.encode({"a": np.zeros(0, np.dtype(dt))})
    assert frames == [want]
    assert codec.encode({"a": np.zeros(0, np.dtype(dt))}, inline_max=None)[0] != want  # every array in a frame
    big = np.dtype(dt).newbyteorder(">")
    if big.str != dt:  # a big-endian empty array is sent as its little-endian twin
        assert codec.encode({"a": np.zeros(0, big)}) == [want]
    one, two = codec.decode(frames)["a"], codec.decode(frames)["a"]
    assert one.dtype == np.dtype(dt) and one.shape == (0,) and one.flags.writeable and one is not two
    assert codec.decode(codec.encode({"a": np.zeros((0, 2), np.dtype(dt))}))["a"].shape == (0, 2)


@pytest.mark.parametrize("desc,why", [
    (["<i4", [3], b"\0" * 5], "needs 12"),
    (["|O", [1], b"\0" * 8], "not allowed"),
    (["<i4", [-1], b""], "bad array shape"),
    (["<i4", [1], "abcd"], "must be binary"),
    (["<i4", [1]], "bad array descriptor"),
])
def test_a_bad_inline_array_is_a_codec_error(desc, why):
    import msgpack

    head = msgpack.packb({"v": 1, "x": msgpack.ExtType(codec.INLINE_EXT, msgpack.packb(desc, use_bin_type=True))})
    with pytest.raises(codec.CodecError, match=why):
        codec.decode([head])


def test_a_forwarded_message_passes_its_small_arrays_through_unbuilt():
    """The gateway's results: small arrays stay msgpack ExtType objects, packed again as they
    came; a receiver of the re-encoded message reads the same arrays. Arrays in frames (whose
    indices a forwarder changes) are built as ``decode`` builds them."""
    import msgpack

    small = {"ids": np.arange(7, dtype=np.int32), "lp": np.linspace(-1, 0, 5, dtype=np.float32), "n": 3}
    frames = codec.encode({"kind": "result", "trajectory": small})
    fwd = codec.decode_forwarded(frames)
    assert isinstance(fwd["trajectory"]["ids"], msgpack.ExtType) and fwd["trajectory"]["n"] == 3
    again = codec.encode({"results": [fwd["trajectory"]]})
    assert len(again) == 1
    got = codec.decode(again)["results"][0]
    assert got["ids"].tolist() == list(range(7)) and got["lp"].dtype == np.float32
    assert got["lp"].tolist() == small["lp"].tolist()
    # Built, for a receiver that takes ext 1 frames only.
    built = codec.build_arrays(fwd["trajectory"])
    assert isinstance(built["ids"], np.ndarray) and built["ids"].tolist() == list(range(7))
    assert len(codec.encode(built, inline_max=None)) == 3
    # A large array travels as a frame: decoded (built) the usual way.
    big = codec.encode({"trajectory": {"ids": np.arange(10_000, dtype=np.int32)}})
    assert len(big) == 2
    assert codec.decode_forwarded(big)["trajectory"]["ids"].tolist() == list(range(10_000))


@pytest.mark.parametrize("frames", [[b""], [b"\x91\x01"], [b"\xc1"], [b"\x81\xa1a"], [b"\x81\x01\x02"],
                                    [codec.encode({"a": 1})[0] + b"\x01"]])
def test_a_bad_forwarded_message_is_a_codec_error(frames):
    with pytest.raises(codec.CodecError):
        codec.decode_forwarded(frames)
