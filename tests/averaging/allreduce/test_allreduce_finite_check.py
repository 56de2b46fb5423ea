"""Checking a member's tensors for NaN/Inf chunk by chunk as the codec encodes them
(``FiniteCheck.AS_ENCODED``): the daemon's mode for a client's shared memory,
which the client checked as it wrote it. The result is the same as with the scan up front;
a caller that lied fails alone, mid-round, and the rest of its group finishes."""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

from swarmavg.averaging.aggregation import canonical_aggregation
from swarmavg.averaging.allreduce.load_balancing import part_sizes
from swarmavg.averaging.allreduce.runner import FiniteCheck
from swarmavg.averaging.errors import InvalidTensorsError
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import close_peers, make_group, run_group, start_peers
from tests.harness import GrpcServerPool

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("allreduce_transport")]

N = 3
SIZE = 30_000  # parts of 10,000 elements, about 10 chunks each at the tests' 4 KiB chunks
AS_ENCODED = dict.fromkeys(range(N), FiniteCheck.AS_ENCODED)


def _inputs(seed: int) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    return [[rng.standard_normal(SIZE).astype(np.float32)] for _ in range(N)]


def _copies(inputs: list[list[np.ndarray]]) -> list[list[np.ndarray]]:
    return [[t.copy() for t in ts] for ts in inputs]


@pytest.mark.parametrize("codec", ["none", "float16", "uint8-blockwise"])
async def test_checking_chunks_as_they_are_encoded_gives_the_scans_result(
    grpc_servers: GrpcServerPool, channels: ChannelPool, codec: str
) -> None:
    peers = await start_peers(grpc_servers, N)
    try:
        originals = _inputs(seed=3)
        weights = [1.0, 2.0, 0.5]
        scanned = _copies(originals)
        group = make_group(peers, originals[0], codec=codec)
        upfront = await run_group(peers, group, scanned, weights, channels, outs=scanned)
        encoded = _copies(originals)
        group = make_group(peers, originals[0], codec=codec)
        checked = await run_group(
            peers, group, encoded, weights, channels, outs=encoded, finite_checks=AS_ENCODED
        )
        for a, b in zip(upfront, checked, strict=True):
            assert isinstance(a, AveragingResult), a
            assert isinstance(b, AveragingResult), b
            assert not a.partial
            assert not b.partial
            np.testing.assert_allclose(a.tensors[0], b.tensors[0], rtol=1e-5, atol=1e-6)
        first = checked[0]
        assert isinstance(first, AveragingResult)
        for other in checked[1:]:
            assert isinstance(other, AveragingResult)
            assert other.tensors[0].tobytes() == first.tensors[0].tobytes()
    finally:
        await close_peers(peers)


@pytest.mark.parametrize("codec", ["none", "float16", "uint8-blockwise", "topk:fraction=0.1"])
@pytest.mark.parametrize("where", ["own part", "another part"])
async def test_a_nan_found_as_it_is_encoded_fails_its_owner_alone(
    grpc_servers: GrpcServerPool, channels: ChannelPool, codec: str, where: str
) -> None:
    """Member 1 says its tensors were checked, and one element in the middle of a part is
    NaN: member 1 fails with InvalidTensorsError (once its codec meets that chunk, or, for
    ``none`` to another reducer, once that reducer refused it), the others finish with
    finite, partial results, and the next round (top-k's error feedback included) is
    whole again."""
    peers = await start_peers(grpc_servers, N)
    try:
        inputs = _inputs(seed=4)
        group = make_group(peers, inputs[0], codec=codec)
        bounds = np.cumsum([0, *part_sizes(group.members, SIZE)])
        part = 1 if where == "own part" else 2
        inputs[1][0][(bounds[part] + bounds[part + 1]) // 2] = np.nan
        results = await run_group(
            peers, group, inputs, [1.0] * N, channels, outs=inputs, finite_checks=AS_ENCODED
        )
        assert isinstance(results[1], InvalidTensorsError), results[1]
        assert "NaN or Inf" in str(results[1])
        if codec == "none":
            # not checked as encoded: part 2's reducer refused the chunk, or member 1's
            # own reducer could not encode its non-finite average; member 1 found it
            # among the chunks that kept its own values
            assert "did not average" in str(results[1])
        for i in (0, 2):
            result = results[i]
            assert isinstance(result, AveragingResult), result
            assert result.partial
            assert np.isfinite(result.tensors[0]).all()

        after = _inputs(seed=5)
        expected = np.mean([ts[0] for ts in after], axis=0)
        group = make_group(peers, after[0], codec=codec)
        again = await run_group(
            peers, group, after, [1.0] * N, channels, outs=after, finite_checks=AS_ENCODED
        )
        for result in again:
            assert isinstance(result, AveragingResult), result
            assert not result.partial
            assert np.isfinite(result.tensors[0]).all()
        if codec == "none":
            first = again[0]
            assert isinstance(first, AveragingResult)
            np.testing.assert_allclose(first.tensors[0], expected, rtol=1e-5, atol=1e-6)
    finally:
        await close_peers(peers)


async def test_the_scan_up_front_refuses_before_anything_is_sent(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    """The default, for contrast: the same NaN fails the call before the round starts."""
    peers = await start_peers(grpc_servers, N)
    try:
        inputs = _inputs(seed=6)
        inputs[1][0][SIZE // 2] = np.nan
        group = make_group(peers, inputs[0])
        results = await run_group(peers, group, inputs, [1.0] * N, channels, timeout=10.0)
        assert isinstance(results[1], ValueError), results[1]
        assert not isinstance(results[1], InvalidTensorsError)  # the scan's plain error
        assert "NaN or Inf" in str(results[1])
    finally:
        await close_peers(peers)


@pytest.mark.parametrize("aggregation", ["trimmed-mean", "centered-clip"])
async def test_robust_rules_get_checked_copies_even_with_codec_none(
    grpc_servers: GrpcServerPool, channels: ChannelPool, aggregation: str
) -> None:
    """Under a robust rule the reducer sorts and compares the copies, so ``none`` checks
    a member's own part as it encodes it: the NaN is found there, not in the average."""
    peers = await start_peers(grpc_servers, N)
    try:
        inputs = _inputs(seed=7)
        group = make_group(peers, inputs[0])
        group = dataclasses.replace(group, aggregation=canonical_aggregation(aggregation))
        bounds = np.cumsum([0, *part_sizes(group.members, SIZE)])
        inputs[1][0][(bounds[1] + bounds[2]) // 2] = np.nan
        results = await run_group(
            peers, group, inputs, [1.0] * N, channels, outs=inputs, finite_checks=AS_ENCODED
        )
        assert isinstance(results[1], InvalidTensorsError), results[1]
        assert "did not average" not in str(results[1])  # found as it was encoded
        for i in (0, 2):
            result = results[i]
            assert isinstance(result, AveragingResult), result
            assert np.isfinite(result.tensors[0]).all()
    finally:
        await close_peers(peers)
