"""Flatten/unflatten round trips and the part/chunk plan (pure logic)."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from swarmavg.averaging.allreduce.partition import (
    MIN_CHUNK_ELEMENTS,
    PartPlan,
    TensorLayout,
    chunk_elements_for,
    flatten,
    unflatten,
)
from swarmavg.averaging.group import Member, Mode, schema_hash

FLOATS = [np.float16, ml_dtypes.bfloat16, np.float32, np.float64]
INTS = [np.int8, np.uint8, np.int32, np.int64]


def _sample(dtype: type, shape: tuple[int, ...], rng: np.random.Generator) -> np.ndarray:
    if np.dtype(dtype).kind in "iu":
        info = np.iinfo(dtype)
        lo, hi = max(info.min, -(2**40)), min(info.max, 2**40)
        return rng.integers(lo, hi, size=shape, endpoint=True).astype(dtype)
    return rng.standard_normal(shape).astype(dtype)


@pytest.mark.parametrize("dtype", FLOATS + INTS)
def test_round_trip_is_bit_exact_per_dtype(dtype: type) -> None:
    rng = np.random.default_rng(0)
    tensors = [_sample(dtype, s, rng) for s in [(3, 4), (), (0,), (7,), (2, 1, 5)]]
    layout = TensorLayout.of(tensors)
    vector = flatten(tensors, layout)
    back = unflatten(vector, layout)
    assert len(back) == len(tensors)
    for a, b in zip(tensors, back, strict=True):
        assert b.dtype == a.dtype
        assert b.shape == a.shape
        assert a.tobytes() == b.tobytes()


def test_reduction_dtype_widening() -> None:
    f16 = np.zeros(3, np.float16)
    bf16 = np.zeros(3, ml_dtypes.bfloat16)
    assert TensorLayout.of([f16, bf16]).dtype == np.float32
    assert TensorLayout.of([f16, np.zeros(1, np.int8)]).dtype == np.float32
    assert TensorLayout.of([f16, np.zeros(1, np.float64)]).dtype == np.float64
    assert TensorLayout.of([np.zeros(1, np.int64)]).dtype == np.float64


def test_mixed_dtypes_keep_order_and_do_not_alias() -> None:
    rng = np.random.default_rng(1)
    tensors = [_sample(d, (5, 3), rng) for d in FLOATS + INTS]
    layout = TensorLayout.of(tensors)
    vector = flatten(tensors, layout)
    assert vector.dtype == np.float64
    back = unflatten(vector, layout)
    for a, b in zip(tensors, back, strict=True):
        assert a.tobytes() == b.tobytes()
        assert a.dtype == b.dtype
    vector[:] = 0
    assert any(np.any(b != 0) for b in back)


def test_non_contiguous_inputs_are_not_modified() -> None:
    base = np.arange(24, dtype=np.float32).reshape(4, 6)
    view = base[:, ::2]
    layout = TensorLayout.of([view])
    vector = flatten([view], layout)
    np.testing.assert_array_equal(vector, view.reshape(-1))
    vector += 1
    np.testing.assert_array_equal(base, np.arange(24, dtype=np.float32).reshape(4, 6))


def test_integer_results_round_and_clip() -> None:
    layout = TensorLayout.of([np.zeros(4, np.int8), np.zeros(2, np.uint8)])
    vector = np.array([1.4, 1.6, -300.0, 300.0, -1.0, 255.7], dtype=np.float32)
    a, b = unflatten(vector, layout)
    assert a.tolist() == [1, 2, -128, 127]
    assert b.tolist() == [0, 255]


@pytest.mark.parametrize(
    "bad", [[], [np.zeros(2, np.complex64)], [np.zeros(2, bool)], [np.zeros(2, "U3")]]
)
def test_unsupported_inputs_raise(bad: list[np.ndarray]) -> None:
    with pytest.raises(ValueError, match=r"empty|unsupported"):
        TensorLayout.of(bad)


def test_layout_mismatch_raises() -> None:
    layout = TensorLayout.of([np.zeros((2, 3), np.float32)])
    with pytest.raises(ValueError, match="layout"):
        flatten([np.zeros((3, 2), np.float32)], layout)
    with pytest.raises(ValueError, match="shape"):
        unflatten(np.zeros(5, np.float32), layout)


def test_schema_hash_sees_shapes_dtypes_and_order_not_values() -> None:
    a = [np.zeros((2, 3), np.float32), np.zeros(4, np.float16)]
    assert schema_hash(a) == schema_hash([np.ones((2, 3), np.float32), np.ones(4, np.float16)])
    assert schema_hash(a) != schema_hash(a[::-1])
    assert schema_hash(a) != schema_hash([np.zeros((3, 2), np.float32), a[1]])
    assert schema_hash(a) != schema_hash([a[0], np.zeros(4, np.float32)])
    assert schema_hash([np.zeros(6)]) != schema_hash([np.zeros((6, 1))])


@settings(max_examples=60, deadline=None)
@given(
    sizes=st.lists(st.integers(0, 5000), min_size=1, max_size=8),
    chunk=st.integers(1, 3000),
)
def test_plan_covers_every_element_once(sizes: list[int], chunk: int) -> None:
    plan = PartPlan.build(sizes, chunk)
    assert plan.total == sum(sizes)
    covered = np.zeros(plan.total, dtype=np.int64)
    for part, (start, _end) in enumerate(plan.bounds):
        assert plan.part_size(part) == sizes[part]
        for c in range(plan.num_chunks(part)):
            lo, hi = plan.chunk_bounds(part, c)
            assert 0 < hi - lo <= chunk
            covered[start + lo : start + hi] += 1
    assert (covered == 1).all()


def test_chunk_index_out_of_range() -> None:
    plan = PartPlan.build([10, 0], 4)
    assert plan.num_chunks(0) == 3
    assert plan.num_chunks(1) == 0
    assert plan.chunk_bounds(0, 2) == (8, 10)
    with pytest.raises(IndexError):
        plan.chunk_bounds(0, 3)
    with pytest.raises(IndexError):
        plan.chunk_bounds(1, 0)


def test_chunk_elements_follow_the_codec_size() -> None:
    assert chunk_elements_for(4.0, 512 * 1024) == 128 * 1024
    assert chunk_elements_for(1.0, 512 * 1024) == 512 * 1024
    assert chunk_elements_for(1000.0, 4096) == MIN_CHUNK_ELEMENTS
    with pytest.raises(ValueError, match="bytes_per_element"):
        chunk_elements_for(0.0)


def test_member_and_group_validation() -> None:
    with pytest.raises(ValueError, match="peer_id"):
        Member(b"x", "a:1", Mode.NODE)
    with pytest.raises(ValueError, match="address"):
        Member(b"p" * 20, None, Mode.NODE, 1.0)
    with pytest.raises(ValueError, match="bandwidth"):
        Member(b"p" * 20, "a:1", Mode.NODE, float("nan"))
    assert not Member(b"p" * 20, None, Mode.CLIENT, 5.0).is_reducer
    assert Mode.AUX.reduces
    assert not Mode.AUX.sends
