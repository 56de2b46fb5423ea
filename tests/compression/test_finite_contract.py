"""The two finite-check shortcuts: ``CodecInfo.finite`` and ``Codec.decodes_finite``."""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.compression import CodecError, CodecInfo, get_codec, known_codecs
from swarmavg.compression.base import Header


@pytest.mark.parametrize("name", ["none", "float16", "uint8-blockwise", "uint8-quantile", "topk"])
def test_finite_hint_changes_nothing_for_finite_input(name: str) -> None:
    x = np.random.default_rng(0).standard_normal(10_000).astype(np.float32)
    plain = get_codec(name).encode_payload(x, CodecInfo(key="k"))
    hinted = get_codec(name).encode_payload(x, CodecInfo(key="k", finite=True))
    assert plain.header == hinted.header
    assert bytes(plain.payload) == bytes(hinted.payload)


def test_without_the_hint_nan_input_is_refused() -> None:
    x = np.array([1.0, np.nan], np.float32)
    for name in ("none", "uint8-quantile", "topk"):
        with pytest.raises(CodecError, match="NaN or Inf"):
            get_codec(name).encode_payload(x, CodecInfo())


def test_float64_input_that_overflows_float32_is_refused_despite_the_hint() -> None:
    x = np.array([1.0, 1e300], np.float64)  # finite, but not in float32
    for name in ("uint8-quantile", "topk"):
        with pytest.raises(CodecError, match="NaN or Inf"):
            get_codec(name).encode_payload(x, CodecInfo(finite=True))


def _forge_nan(name: str, payload: bytes) -> bytes:
    """A payload of codec ``name`` for finite values, altered to carry NaN/Inf."""
    if name == "none":
        return np.array([0.5, np.nan, np.inf] * 100, np.float32)[:300].tobytes()
    if name in ("float16", "bfloat16"):
        words = np.frombuffer(payload, np.uint16).copy()
        words[1] = 0x7E00 if name == "float16" else 0x7FC0  # a NaN
        words[2] = 0x7C00 if name == "float16" else 0x7F80  # +Inf
        return words.tobytes()
    if name == "sparseloco":  # the first block's (low, high) levels open the payload
        raw = bytearray(payload)
        raw[:4] = np.float32(np.nan).tobytes()
        return bytes(raw)
    if name.endswith("-blockwise"):  # the block scales are the payload's last float32s
        raw = bytearray(payload)
        raw[-4:] = np.float32(np.nan).tobytes()
        return bytes(raw)
    raise AssertionError(f"no forgery for {name}: add one")


def test_codecs_that_claim_finite_output_refuse_nan_payloads() -> None:
    names = [n for n in known_codecs() if "<" not in n]
    claiming = [n for n in names if get_codec(n).decodes_finite]
    assert {"none", "float16", "bfloat16", "uint8-blockwise", "uint4-blockwise"} <= set(claiming)
    x = np.random.default_rng(2).standard_normal(300).astype(np.float32)
    for name in claiming:
        codec = get_codec(name)
        encoded = codec.encode_payload(x, CodecInfo())
        assert np.isfinite(codec.decode_payload(encoded.header, encoded.payload)).all()
        with pytest.raises(CodecError, match=r"NaN or Inf|Inf or NaN|must be finite"):
            codec.decode_payload(encoded.header, _forge_nan(name, bytes(encoded.payload)))


def test_decoded_views_are_read_only_but_public_decode_is_writable() -> None:
    codec = get_codec("none")
    x = np.arange(6, dtype=np.float32)
    message = codec.encode(x)
    view = codec.decode_payload(Header("none", np.dtype(np.float32), (6,)), message.buffer)
    assert not view.flags.writeable
    out = codec.decode(message)
    assert out.flags.writeable
    out[0] = 42.0  # owned: does not touch the message
    np.testing.assert_array_equal(codec.decode(message), x)


def test_exact_codecs_round_trip_bit_for_bit() -> None:
    names = [n for n in known_codecs() if "<" not in n]
    exact = [n for n in names if get_codec(n).exact]
    assert exact == ["none"]
    x = np.random.default_rng(1).standard_normal(1000).astype(np.float32) * 1e30
    for dtype in (np.float32, np.float64, np.int64):
        a = x.astype(dtype) if dtype != np.int64 else np.arange(1000, dtype=dtype)
        out = get_codec("none").decode(get_codec("none").encode(a))
        assert out.tobytes() == a.tobytes()


def test_an_unchecked_decode_says_whether_it_checked() -> None:
    """``decode_payload_unchecked``: the values ``decode_payload`` gives, and whether they
    were checked. Codecs whose decoding checks for free check (a forged NaN is refused as
    before); ``none`` hands the payload over unchecked (the all-reduce's mean checks it in
    the pass that combines the copies), and so does ``float16`` for float32, as its words
    (float16 values, which widen exactly); integer payloads need no check."""
    names = [n for n in known_codecs() if "<" not in n]
    x = np.random.default_rng(3).standard_normal(300).astype(np.float32)
    unchecked = {"none", "float16"}
    for name in names:
        codec = get_codec(name)
        encoded = codec.encode_payload(x, CodecInfo())
        values, checked = codec.decode_payload_unchecked(encoded.header, encoded.payload)
        expected = codec.decode_payload(encoded.header, encoded.payload)
        assert values.dtype == (np.float16 if name == "float16" else np.float32)
        assert values.astype(np.float32).tobytes() == expected.tobytes()
        assert checked == (codec.decodes_finite and name not in unchecked)
        if checked:
            with pytest.raises(CodecError):
                codec.decode_payload_unchecked(
                    encoded.header, _forge_nan(name, bytes(encoded.payload))
                )
    none = get_codec("none")
    forged = _forge_nan("none", b"")
    header = Header("none", np.dtype(np.float32), (300,))
    values, checked = none.decode_payload_unchecked(header, forged)
    assert not checked
    assert values.tobytes() == forged  # as it came, a view of the payload
    half = get_codec("float16")
    encoded = half.encode_payload(x, CodecInfo())
    forged = _forge_nan("float16", bytes(encoded.payload))
    values, checked = half.decode_payload_unchecked(encoded.header, forged)
    assert not checked
    assert values.tobytes() == forged  # the words as they came
    # float64 is decoded (and checked) as before: the words widen to float32 only
    wide = half.encode_payload(x.astype(np.float64), CodecInfo())
    values, checked = half.decode_payload_unchecked(wide.header, wide.payload)
    assert checked
    assert values.dtype == np.float64
    with pytest.raises(CodecError):
        half.decode_payload_unchecked(wide.header, _forge_nan("float16", bytes(wide.payload)))
    with pytest.raises(CodecError, match="needs 1200"):
        none.decode_payload_unchecked(header, forged[:-4])
    integers = np.arange(10, dtype=np.int64)
    encoded = none.encode_payload(integers, CodecInfo())
    assert none.decode_payload_unchecked(encoded.header, encoded.payload)[1]


def test_codecs_that_decode_cleanly_leave_out_untouched_on_a_bad_payload() -> None:
    """``decodes_into_cleanly``: a NaN-carrying or short payload raises before anything is
    written into ``out`` (the all-reduce decodes replies over the caller's values)."""
    names = [n for n in known_codecs() if "<" not in n]
    clean = [n for n in names if get_codec(n).decodes_into_cleanly]
    assert "uint8-blockwise" in clean
    x = np.random.default_rng(4).standard_normal(300).astype(np.float32)
    for name in clean:
        codec = get_codec(name)
        assert codec.decodes_finite  # what it writes is finite too
        encoded = codec.encode_payload(x, CodecInfo())
        payload = bytes(encoded.payload)
        for bad in (_forge_nan(name, payload), payload[:-1]):
            out = np.full(300, 7.0, np.float32)
            with pytest.raises(CodecError):
                codec.decode_payload_into(encoded.header, bad, out)
            assert (out == 7.0).all()
