"""``sparseloco``: the math by hand on tiny tensors, error feedback across rounds and a
reload, the reducer's lossless-support encoding, and refusal of malformed messages."""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.compression import CodecError, CodecInfo, ErrorFeedback, SparseLoCoCodec, get_codec
from swarmavg.compression.base import Header

KEY = CodecInfo(key="delta")


def round_trip(codec: SparseLoCoCodec, x: np.ndarray, info: CodecInfo = KEY) -> np.ndarray:
    encoded = codec.encode_payload(np.asarray(x, np.float32), info)
    return np.asarray(codec.decode_payload(encoded.header, encoded.payload))


def test_one_block_by_hand_then_the_residual_is_sent_next_round() -> None:
    codec = SparseLoCoCodec(fraction=0.75, block=4)  # k = 3 of 4
    x = np.array([0.1, -0.5, 0.2, 0.05], np.float32)
    # Kept: 0.1, -0.5, 0.2 (magnitudes 0.1 < 0.2 <= 0.5). The upper median is 0.2, so
    # 0.2 and 0.5 are "high" (level 0.35) and 0.1 is "low" (level 0.1).
    first = round_trip(codec, x)
    np.testing.assert_allclose(first, [0.1, -0.35, 0.35, 0.0], atol=1e-7)
    residual = codec.feedback.peek(("delta", 0)) if codec.feedback else None
    assert residual is not None
    np.testing.assert_allclose(residual, [0.0, -0.15, -0.15, 0.05], atol=1e-7)
    # A zero input next round sends the residual itself: its three entries are kept
    # (0.05 low; 0.15 and 0.15 high), and the two rounds together sent x exactly.
    second = round_trip(codec, np.zeros(4, np.float32))
    np.testing.assert_allclose(second, [0.0, -0.15, -0.15, 0.05], atol=1e-7)
    np.testing.assert_allclose(first + second, x, atol=1e-7)


def test_blocks_are_selected_separately_and_the_short_last_block_too() -> None:
    codec = SparseLoCoCodec(fraction=0.25, block=4, error_feedback=False)  # k = 1 per block
    x = np.array([1.0, 2.0, 3.0, -9.0, 0.5, 0.1, 0.2, 0.3, 0.0, 7.0], np.float32)
    encoded = codec.encode_payload(x, KEY)
    assert encoded.header.meta == {"mode": "topk2", "block": 4, "k": 1, "k_last": 1}
    out = codec.decode_payload(encoded.header, encoded.payload)
    np.testing.assert_array_equal(out, [0, 0, 0, -9, 0.5, 0, 0, 0, 0, 7])


def test_error_feedback_conserves_what_was_not_sent_and_decay_scales_it() -> None:
    rng = np.random.default_rng(0)
    codec = SparseLoCoCodec(fraction=0.02, block=512)
    previous = np.zeros(3000, np.float32)
    for _ in range(5):
        x = rng.standard_normal(3000).astype(np.float32)
        sent = round_trip(codec, x)
        assert np.count_nonzero(sent) <= 6 * 11 + 3  # ceil(2% of 512) = 11 per block
        residual = codec.feedback.peek(("delta", 0)) if codec.feedback else None
        assert residual is not None
        np.testing.assert_allclose(sent + residual, x + previous, atol=1e-5)
        previous = residual
    decayed = SparseLoCoCodec(fraction=0.02, block=512, decay=0.5)
    x = rng.standard_normal(3000).astype(np.float32)
    round_trip(decayed, x)
    left = decayed.feedback.peek(("delta", 0)) if decayed.feedback else None
    assert left is not None
    sent = round_trip(decayed, np.zeros(3000, np.float32))
    after = decayed.feedback.peek(("delta", 0)) if decayed.feedback else None
    assert after is not None
    np.testing.assert_allclose(sent + after, 0.5 * left, atol=1e-6)


def test_the_residual_survives_a_reload_and_is_kept_per_key() -> None:
    rng = np.random.default_rng(1)
    xs = [rng.standard_normal(2000).astype(np.float32) for _ in range(3)]
    running = SparseLoCoCodec(fraction=0.03, block=256)
    round_trip(running, xs[0])
    round_trip(running, xs[0], CodecInfo(key="other"))
    assert running.feedback is not None
    restored = SparseLoCoCodec(
        fraction=0.03, block=256, feedback=ErrorFeedback.from_bytes(running.feedback.to_bytes())
    )
    without = SparseLoCoCodec(fraction=0.03, block=256).encode_payload(xs[1], KEY)
    for i, x in enumerate(xs[1:]):
        a = running.encode_payload(x, KEY)
        b = restored.encode_payload(x, KEY)
        assert bytes(a.payload) == bytes(b.payload)
        if i == 0:  # and the residual did change what was sent
            assert bytes(a.payload) != bytes(without.payload)
    assert sorted(running.feedback.entries()) == [("delta", 0), ("other", 0)]


def test_the_reducers_mean_keeps_every_nonzero_to_half_precision() -> None:
    rng = np.random.default_rng(2)
    codec = get_codec("sparseloco:fraction=0.02,block=1024")
    decoded = [
        round_trip(codec, rng.standard_normal(5000), CodecInfo(key=f"m{i}")) for i in range(4)
    ]  # type: ignore[arg-type]
    weights = np.array([1.0, 2.0, 0.5, 1.0], np.float32)
    mean = sum(w * d for w, d in zip(weights, decoded, strict=True)) / weights.sum()
    encoded = codec.encode_payload(mean, CodecInfo(key="avg", reduced=True))
    assert encoded.header.meta["mode"] == "union"
    out = codec.decode_payload(encoded.header, encoded.payload)
    assert set(np.flatnonzero(out)) == set(np.flatnonzero(mean))
    np.testing.assert_allclose(out, mean, rtol=2**-11, atol=np.abs(mean).max() * 2**-24)
    # Denser than one member's message, but only by the union of their supports:
    # ceil(2% of 1024) = 21 per block, 5 blocks (the last 904 long: 19), 4 members.
    assert encoded.header.meta["count"] <= 4 * (4 * 21 + 19)


def test_the_sent_bytes_are_about_2_bytes_and_a_quarter_per_kept_value() -> None:
    codec = SparseLoCoCodec()  # 64 of every 4096
    x = np.random.default_rng(3).standard_normal(4096 * 16).astype(np.float32)
    encoded = codec.encode_payload(x, KEY)
    assert len(encoded.payload) == 16 * 8 + 16 * 64 * 2 + 16 * 64 // 4
    assert len(encoded.payload) / x.nbytes < 1 / 100


def _header(meta: dict[str, object], n: int = 8) -> Header:
    return Header("sparseloco", np.dtype(np.float32), (n,), meta)


@pytest.mark.parametrize(
    ("meta", "payload", "match"),
    [
        ({"mode": "dense"}, b"", "mode"),
        ({"mode": "topk2", "block": 4, "k": 1, "k_last": 0}, b"\0" * 5, "payload is"),
        ({"mode": "topk2", "block": 4, "k": 5, "k_last": 0}, b"", "meta"),
        (
            {"mode": "topk2", "block": 4, "k": 1, "k_last": 0},
            np.ones(4, "<f4").tobytes() + bytes([4, 0, 0]),
            "out of range",
        ),
        ({"mode": "union", "count": 1, "width": 1, "scale": 1.0}, bytes([8, 0, 60]), "range"),
        ({"mode": "union", "count": 1, "width": 1, "scale": 1e39}, bytes([0, 0, 60]), "scale"),
    ],
)
def test_malformed_messages_are_refused(
    meta: dict[str, object], payload: bytes, match: str
) -> None:
    with pytest.raises(CodecError, match=match):
        SparseLoCoCodec().decode_payload(_header(meta), payload)


def test_bad_parameters_fail_at_construction() -> None:
    for kwargs in ({"fraction": 0.0}, {"block": 0}, {"block": 1 << 17}, {"decay": 1.5}):
        with pytest.raises(ValueError, match="must be"):
            SparseLoCoCodec(**kwargs)  # type: ignore[arg-type]
