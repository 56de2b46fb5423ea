"""Top-k error feedback (state, memory bound, checkpoints) and the adaptive selectors."""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.compression import CodecError, CodecInfo, Role, decode_chunk, get_codec
from swarmavg.compression.adaptive import KeyAdaptiveCodec, RoleAdaptiveCodec, SizeAdaptiveCodec
from swarmavg.compression.blockwise import Blockwise4BitCodec
from swarmavg.compression.feedback import ErrorFeedback
from swarmavg.compression.floating import BFloat16Codec, NoneCodec
from swarmavg.compression.topk import TopKCodec
from tests.compression.helpers import normal


def _run_rounds(codec: TopKCodec, rounds: int, n: int = 2000) -> tuple[np.ndarray, np.ndarray]:
    rng = np.random.default_rng(0)
    sent = np.zeros(n)
    inputs = np.zeros(n)
    drift = rng.standard_normal(n)  # a persistent direction, as in real gradients
    for _ in range(rounds):
        x = (drift + rng.standard_normal(n)).astype(np.float32)
        inputs += x
        sent += decode_chunk(codec.encode(x, CodecInfo(key="grad", part_index=3)))
    return inputs, sent


def test_error_feedback_transmits_the_sum_of_inputs() -> None:
    codec = TopKCodec(fraction=0.02)
    inputs, sent = _run_rounds(codec, rounds=300)
    assert codec.feedback is not None
    residual = codec.feedback.peek(("grad", 3))
    assert residual is not None
    # Exactly: everything not yet sent is in the residual.
    assert np.allclose(inputs - sent, residual, atol=1e-3)
    # And the residual stays bounded, so the transmitted sum tracks the input sum.
    assert np.linalg.norm(inputs - sent) < 0.1 * np.linalg.norm(inputs)
    plain_inputs, plain_sent = _run_rounds(TopKCodec(fraction=0.02, error_feedback=False), 300)
    assert np.linalg.norm(plain_inputs - plain_sent) > 0.5 * np.linalg.norm(plain_inputs)


def test_residuals_are_kept_per_key_and_part() -> None:
    codec = TopKCodec(fraction=0.1)
    assert codec.feedback is not None
    for key, part in [("a", 0), ("a", 1), ("b", 0)]:
        codec.encode(normal(100), CodecInfo(key=key, part_index=part))
    assert sorted(codec.feedback.entries()) == [("a", 0), ("a", 1), ("b", 0)]
    codec.feedback.reset("a")
    assert codec.feedback.entries() == [("b", 0)]
    codec.feedback.reset()
    assert len(codec.feedback) == 0
    assert codec.feedback.nbytes == 0


def test_changed_part_size_discards_the_residual() -> None:
    codec = TopKCodec(fraction=0.1)
    assert codec.feedback is not None
    codec.encode(normal(100), CodecInfo(key="a"))
    x = normal(50, seed=3)
    # With the stale 100-element residual dropped, the result is plain top-k of x.
    assert np.array_equal(
        decode_chunk(codec.encode(x, CodecInfo(key="a"))),
        decode_chunk(TopKCodec(fraction=0.1, error_feedback=False).encode(x)),
    )
    assert codec.feedback.evicted == 1


def test_memory_bound_evicts_least_recently_used() -> None:
    fb = ErrorFeedback(max_bytes=1000)  # room for two 100-element residuals
    codec = TopKCodec(fraction=0.1, feedback=fb)
    for key in "abc":
        codec.encode(normal(100), CodecInfo(key=key))
    assert fb.nbytes <= 1000
    assert [k for k, _ in fb.entries()] == ["b", "c"]
    assert fb.evicted == 1
    codec.encode(normal(1000), CodecInfo(key="huge"))  # larger than the bound: not kept
    assert ("huge", 0) not in fb.entries()
    assert fb.nbytes <= 1000


def test_checkpoint_restores_identical_behaviour() -> None:
    a = TopKCodec(fraction=0.05)
    for i in range(5):
        a.encode(normal(500, seed=i), CodecInfo(key="w", part_index=i % 2))
    assert a.feedback is not None
    blob = a.feedback.to_bytes()
    b = TopKCodec(fraction=0.05, feedback=ErrorFeedback.from_bytes(blob))
    for i in range(5, 8):
        x = normal(500, seed=i)
        info = CodecInfo(key="w", part_index=i % 2)
        assert a.encode(x, info).buffer == b.encode(x, info).buffer
    with pytest.raises(CodecError, match="not valid msgpack"):
        ErrorFeedback.from_bytes(b"\xc1")
    with pytest.raises(CodecError, match="exceeds max_bytes"):
        ErrorFeedback.from_bytes(blob, max_bytes=100)
    with pytest.raises(CodecError, match="known version"):
        ErrorFeedback().load_state_dict({"version": 99})


def test_topk_gap_width_adapts() -> None:
    sparse = np.zeros(200_000, np.float32)
    sparse[[5, 100_000, 199_999]] = 1.0
    msg = TopKCodec(fraction=3 / 200_000, error_feedback=False).encode(sparse)
    assert len(msg.buffer) == 3 * (4 + 2)  # gaps need 4 bytes here
    assert np.array_equal(decode_chunk(msg), sparse)
    dense = TopKCodec(fraction=0.5, error_feedback=False).encode(normal(1000))
    assert len(dense.buffer) == 500 * (1 + 2)


def test_size_adaptive_picks_by_element_count() -> None:
    codec = get_codec("size-adaptive")
    assert codec.encode(normal(100)).codec == "float16"
    assert codec.encode(normal(1 << 16)).codec == "uint8-blockwise"
    assert codec.encode(np.arange(10)).codec == "none"
    custom = SizeAdaptiveCodec(threshold=10, small=NoneCodec(), large=Blockwise4BitCodec())
    assert custom.encode(normal(9)).codec == "none"
    msg = custom.encode(normal(10))
    assert msg.codec == "uint4-blockwise"
    assert custom.decode(msg).shape == (10,)


def test_role_adaptive_picks_by_role() -> None:
    codec = get_codec("role-adaptive")
    expected = {
        Role.GRADIENT: "uint8-blockwise",
        Role.PARAMETER: "float16",
        Role.OPTIMIZER_STATE: "scaled-float16",
        Role.OTHER: "float16",
    }
    for role, name in expected.items():
        assert codec.encode(normal(1000), CodecInfo(role=role)).codec == name
    custom = RoleAdaptiveCodec({Role.PARAMETER: BFloat16Codec()}, default=NoneCodec())
    assert custom.encode(normal(5), CodecInfo(role="parameter")).codec == "bfloat16"  # type: ignore[arg-type]
    assert custom.encode(normal(5), CodecInfo(role=Role.GRADIENT)).codec == "none"


def test_key_adaptive_first_matching_pattern_wins() -> None:
    codec = KeyAdaptiveCodec(
        [("*.bias", NoneCodec()), ("layer1.*", BFloat16Codec())],
        default=get_codec("uint8-blockwise"),
    )
    assert codec.encode(normal(8), CodecInfo(key="layer1.bias")).codec == "none"
    assert codec.encode(normal(8), CodecInfo(key="layer1.weight")).codec == "bfloat16"
    assert codec.encode(normal(8), CodecInfo(key="head.weight")).codec == "uint8-blockwise"
    msg = codec.encode(normal(8), CodecInfo(key="layer1.weight"))
    assert np.array_equal(codec.decode(msg), decode_chunk(msg))


def test_selector_names_never_appear_in_messages() -> None:
    msg = get_codec("none").encode(normal(4))
    msg.codec = "size-adaptive"
    with pytest.raises(CodecError, match="is a selector"):
        decode_chunk(msg)
