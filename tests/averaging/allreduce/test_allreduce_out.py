"""The all-reduce's data path without fresh buffers: results written into the
caller's ``out``, inputs read from one span, reducers' accumulators reused across rounds."""

from __future__ import annotations

import dataclasses
import itertools

import numpy as np
import pytest

from swarmavg.averaging.aggregation import canonical_aggregation
from swarmavg.averaging.allreduce.buffers import BufferPool
from swarmavg.averaging.allreduce.faults import Fault, FaultPlan
from swarmavg.averaging.allreduce.load_balancing import part_sizes
from swarmavg.averaging.allreduce.partition import (
    PartPlan,
    TensorLayout,
    contiguous_span,
    flat_view,
)
from swarmavg.averaging.allreduce.reducer import ContributionError, PartReducer
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import close_peers, make_group, run_group, start_peers
from tests.harness import GrpcServerPool

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("allreduce_transport")]


def _address(array: np.ndarray) -> int:
    return int(array.__array_interface__["data"][0])


def _inputs(n: int, sizes: list[int], seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(s).astype(np.float32) for s in sizes] for _ in range(n)]


def _one_span(sizes: list[int]) -> list[np.ndarray]:
    """Tensors cut back to back from one flat buffer (as the daemon lays out its copy)."""
    flat = np.full(sum(sizes), np.nan, np.float32)
    bounds = np.cumsum([0, *sizes])
    return [flat[a:b] for a, b in itertools.pairwise(bounds)]


def _assert_same_average(
    fresh: list[object], placed: list[object], outs: list[list[np.ndarray]]
) -> None:
    """Each member's ``placed`` result lies in its ``outs`` and holds the average of the
    ``fresh`` round (a reducer may add the copies in another order, so not always the same
    bits), and every member holds the same bits."""
    results = []
    for a, b, out in zip(fresh, placed, outs, strict=True):
        assert isinstance(a, AveragingResult), a
        assert isinstance(b, AveragingResult), b
        assert not a.partial
        assert not b.partial
        assert [_address(t) for t in b.tensors] == [_address(o) for o in out]
        for x, y in zip(a.tensors, b.tensors, strict=True):
            np.testing.assert_allclose(x, y, rtol=1e-5, atol=1e-6)
        results.append(b)
    for other in results[1:]:
        for x, y in zip(results[0].tensors, other.tensors, strict=True):
            assert x.tobytes() == y.tobytes()


def _gapped(sizes: list[int]) -> list[np.ndarray]:
    """Tensors of one buffer with a gap between them: not one span."""
    flat = np.full(sum(sizes) + 16 * len(sizes), np.nan, np.float32)
    out, cursor = [], 0
    for s in sizes:
        out.append(flat[cursor : cursor + s])
        cursor += s + 16
    return out


@pytest.mark.parametrize("codec", ["none", "uint8-blockwise"])
@pytest.mark.parametrize("shape", ["single", "span", "gapped"])
async def test_results_land_in_out_bit_identical_to_fresh_results(
    grpc_servers: GrpcServerPool, channels: ChannelPool, codec: str, shape: str
) -> None:
    n = 3
    sizes = [7000] if shape == "single" else [3000, 1, 2500]
    peers = await start_peers(grpc_servers, n)
    try:
        inputs = _inputs(n, sizes, seed=5)
        originals = [[t.copy() for t in ts] for ts in inputs]
        weights = [1.0, 2.0, 0.5]
        group = make_group(peers, inputs[0], codec=codec)
        fresh = await run_group(peers, group, inputs, weights, channels)
        make = _gapped if shape == "gapped" else _one_span
        outs = [make(sizes) for _ in range(n)]
        group = make_group(peers, inputs[0], codec=codec)
        placed = await run_group(peers, group, inputs, weights, channels, outs=outs)
        _assert_same_average(fresh, placed, outs)
        for ts, sources in zip(inputs, originals, strict=True):
            for t, original in zip(ts, sources, strict=True):
                assert t.tobytes() == original.tobytes()  # inputs never written
    finally:
        await close_peers(peers)


@pytest.mark.parametrize("in_place", [False, True], ids=["into-out", "in-place"])
async def test_a_partial_round_keeps_local_values_in_out(
    grpc_servers: GrpcServerPool, channels: ChannelPool, in_place: bool
) -> None:
    n = 3
    peers = await start_peers(grpc_servers, n)
    try:
        originals = _inputs(n, [6000], seed=9)
        inputs = [[t.copy() for t in ts] for ts in originals]
        outs = inputs if in_place else [_one_span([6000]) for _ in range(n)]
        group = make_group(peers, inputs[0])
        # Member 2 never reduces its part: the others keep their own values there (and wait
        # the round's timeout out for it).
        faults = {2: FaultPlan(Fault.STOP_REDUCING, 0)}
        results = await run_group(
            peers, group, inputs, [1.0] * n, channels, timeout=2.0, faults=faults, outs=outs
        )
        first = results[0]
        assert isinstance(first, AveragingResult)
        assert first.partial
        assert 2 in first.failed_parts
        sizes = part_sizes(group.members, 6000)
        lo, hi = sum(sizes[:2]), sum(sizes[:3])
        assert hi > lo
        np.testing.assert_array_equal(outs[0][0][lo:hi], originals[0][0][lo:hi])
        assert np.isfinite(outs[0][0]).all()  # every other chunk was written too
        assert not np.array_equal(outs[0][0][:lo], originals[0][0][:lo])  # averaged
    finally:
        await close_peers(peers)


async def test_out_that_overlaps_the_inputs_or_is_read_only_is_refused(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    peers = await start_peers(grpc_servers, 2)
    try:
        inputs = _inputs(2, [100], seed=1)
        group = make_group(peers, inputs[0])
        shared = np.zeros(101, np.float32)
        inputs[0] = [shared[:100]]  # overlapping the inputs without being them
        read_only = np.zeros(100, np.float32)
        read_only.flags.writeable = False
        for bad in ([shared[1:]], [read_only], [np.zeros(99, np.float32)]):
            results = await run_group(
                peers, group, inputs, [1.0, 1.0], channels, timeout=5.0, outs=[bad, None]
            )
            assert isinstance(results[0], ValueError), results[0]
    finally:
        await close_peers(peers)


@pytest.mark.parametrize("codec", ["none", "float16", "uint8-blockwise"])
@pytest.mark.parametrize("shape", ["single", "span", "gapped"])
async def test_in_place_rounds_match_fresh_results(
    grpc_servers: GrpcServerPool, channels: ChannelPool, codec: str, shape: str
) -> None:
    """``out`` is the inputs themselves (the daemon's shared memory): the average lands
    where the inputs were, the same as a round into fresh arrays, bit-identical on every
    member."""
    n = 3
    sizes = [7000] if shape == "single" else [3000, 1, 2500]
    peers = await start_peers(grpc_servers, n)
    try:
        originals = _inputs(n, sizes, seed=6)
        weights = [1.0, 2.0, 0.5]
        group = make_group(peers, originals[0], codec=codec)
        fresh = await run_group(peers, group, originals, weights, channels)
        make = _gapped if shape == "gapped" else _one_span
        inputs = [make(sizes) for _ in range(n)]
        for ts, source in zip(inputs, originals, strict=True):
            for t, s in zip(ts, source, strict=True):
                t[...] = s
        group = make_group(peers, originals[0], codec=codec)
        placed = await run_group(peers, group, inputs, weights, channels, outs=inputs)
        _assert_same_average(fresh, placed, inputs)
    finally:
        await close_peers(peers)


@pytest.mark.parametrize("rule", ["mean", "trimmed-mean"])
async def test_reducers_reuse_their_buffers_across_rounds(
    grpc_servers: GrpcServerPool, channels: ChannelPool, rule: str
) -> None:
    n = 3
    peers = await start_peers(grpc_servers, n)
    try:
        for seed in range(3):
            inputs = _inputs(n, [9000], seed=seed)
            group = dataclasses.replace(
                make_group(peers, inputs[0]), aggregation=canonical_aggregation(rule)
            )
            results = await run_group(peers, group, inputs, [1.0] * n, channels)
            assert all(isinstance(r, AveragingResult) and not r.partial for r in results)
        # A robust rule's copies: round 1 allocated each member's buffer, rounds 2 and 3
        # took it back. The mean holds the copies themselves and takes no buffer.
        expected = 0 if rule == "mean" else 2
        assert [p.service.buffers.reused for p in peers] == [expected] * n
    finally:
        await close_peers(peers)


def test_contiguous_span_sees_views_of_one_buffer_only() -> None:
    sizes = [5, 0, 7]
    span_tensors = _one_span(sizes)
    layout = TensorLayout.of(span_tensors)
    span = contiguous_span(span_tensors, layout)
    assert span is not None
    assert span.size == 12
    assert _address(span) == _address(span_tensors[0])
    assert contiguous_span(_gapped(sizes), layout) is None
    separate = [np.zeros(s, np.float32) for s in sizes]
    assert contiguous_span(separate, layout) is None
    halves = [np.zeros(4, np.float16)]  # float16 is reduced in float32: a copy is needed
    assert contiguous_span(halves, TensorLayout.of(halves)) is None
    view = flat_view(span_tensors, layout)
    assert view is not None
    assert not view.flags.writeable


def test_buffer_pool_reuses_by_size_and_keeps_at_most_its_cap() -> None:
    pool = BufferPool(max_idle_bytes=4096, max_idle=4)
    a = pool.take(256, np.float32)  # 1024 bytes
    pool.give(a)
    b = pool.take(256, np.float32)
    assert _address(a) == _address(b)
    assert pool.reused == 1
    c = pool.take(128, np.float64)  # same byte size as b, but b is taken: a new buffer
    assert _address(c) != _address(b)
    pool.give(b)
    pool.give(c)
    assert pool.idle_bytes == 2048
    for _ in range(4):
        pool.give(np.empty(1024, np.uint8))
    assert pool.idle_bytes == 4096  # the oldest went first
    pool.give(np.empty(8192, np.uint8))  # larger than the cap: not kept
    assert pool.idle_bytes == 4096


def test_buffer_pool_serves_sizes_that_drift_a_little() -> None:
    """A reducer's part follows measured bandwidths: 8 MB one round, 8.3 MB the next."""
    pool = BufferPool()
    first = pool.take(2_000_000, np.float32)
    pool.give(first)
    second = pool.take(2_080_000, np.float32)  # within the first allocation's headroom
    assert pool.reused == 1
    assert _address(second) == _address(first)
    assert second.shape == (2_080_000,)
    pool.give(second)
    pool.take(4_000_000, np.float32)  # far larger: a new buffer, the idle one stays
    assert pool.reused == 1
    assert pool.idle_bytes > 0


def test_a_released_reducer_takes_no_more_contributions() -> None:
    plan = PartPlan.build([10], 4)
    reducer = PartReducer(plan, 0, np.dtype(np.float32), [0])
    reducer.set_weight(0, 1.0)
    finals = reducer.add(0, 0, np.ones(4, np.float32))
    assert finals == [0]
    np.testing.assert_array_equal(reducer.result(0), np.ones(4, np.float32))
    assert reducer.release() is None  # the mean holds no buffer: nothing to hand back
    with pytest.raises(ContributionError):
        reducer.add(0, 1, np.ones(4, np.float32))
