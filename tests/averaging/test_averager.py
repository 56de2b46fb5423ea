"""End-to-end Averager: matchmaking + butterfly all-reduce over real DHT nodes and gRPC."""

from __future__ import annotations

import asyncio
import time

import ml_dtypes
import numpy as np
import pytest

from swarmavg.averaging import (
    AveragerConfig,
    AveragingResult,
    InvalidTensorsError,
    Mode,
    NoGroupError,
)
from tests.averaging.averager_swarm import averager_swarm, fast_config


def member_inputs(i: int) -> list[np.ndarray]:
    rng = np.random.default_rng(i)
    return [
        rng.standard_normal((17, 5)).astype(np.float32),
        rng.standard_normal(33).astype(np.float64),
        rng.standard_normal((2, 3, 4)).astype(np.float16),
        rng.standard_normal(9).astype(ml_dtypes.bfloat16),
        np.array(float(i), dtype=np.float32),
    ]


@pytest.mark.timeout(60)
async def test_weighted_mean_bit_identical_on_all_members() -> None:
    weights = [1.0, 2.0, 0.0, 3.5]
    async with averager_swarm(4) as swarm:
        inputs = [member_inputs(i) for i in range(4)]
        copies = [[a.copy() for a in x] for x in inputs]
        results = await asyncio.gather(
            *(
                p.averager.average(inputs[i], "step-1", weight=weights[i], group_size=4, timeout=20)
                for i, p in enumerate(swarm.peers)
            )
        )
        for before, after in zip(copies, inputs, strict=True):  # caller's arrays untouched
            for a, b in zip(before, after, strict=True):
                assert a.tobytes() == b.tobytes()
        first = results[0]
        for r in results:
            assert r.group_size == 4
            assert not r.partial
            assert r.group_id == first.group_id
            assert r.timings["matchmaking"] >= 0
            assert r.timings["total"] >= r.timings["allreduce"]
            assert r.bytes_sent > 0
            assert r.bytes_received > 0
            for a, b in zip(r.tensors, first.tensors, strict=True):
                assert a.dtype == b.dtype
                assert a.tobytes() == b.tobytes()  # bit-identical across members
        total = sum(weights)
        for t, like in enumerate(inputs[0]):
            wide = np.float64 if like.dtype == np.float64 else np.float32
            expected = sum(
                w * x[t].astype(wide) for w, x in zip(weights, inputs, strict=True)
            ) / wide(total)
            got = first.tensors[t]
            assert got.shape == like.shape
            assert got.dtype == like.dtype
            tolerance = {np.float16: 1e-3, ml_dtypes.bfloat16: 1e-2}.get(like.dtype.type, 1e-6)
            np.testing.assert_allclose(
                got.astype(wide),
                expected.astype(like.dtype).astype(wide),
                rtol=tolerance,
                atol=tolerance,
            )


@pytest.mark.timeout(60)
async def test_client_mode_peer_joins_and_gets_the_mean() -> None:
    """A client-mode peer (no server, never dialled) cannot lead but still averages."""
    async with averager_swarm(2) as swarm:
        client = await swarm.add(fast_config(mode=Mode.CLIENT), client_mode=True)
        values = [1.0, 2.0, 6.0]
        results = await asyncio.gather(
            *(
                p.averager.average([np.full(10, v, np.float32)], "k", group_size=3, timeout=20)
                for p, v in zip(swarm.peers, values, strict=True)
            )
        )
        for r in results:
            assert r.group_size == 3
            np.testing.assert_array_equal(r.tensors[0], np.full(10, 3.0, np.float32))
        assert client.peer_id.hex() in results[0].peers


@pytest.mark.timeout(60)
async def test_input_validation_before_anything_is_sent() -> None:
    async with averager_swarm(1) as swarm:
        averager = swarm.peers[0].averager
        bad_inputs: list[tuple[object, str]] = [
            ([], "empty"),
            ([np.zeros(3, np.complex64)], "unsupported dtype"),
            ([np.array([1.0, np.nan], np.float32)], "NaN/Inf"),
            ([np.array([np.inf], ml_dtypes.bfloat16)], "NaN/Inf"),
            ([[1.0, 2.0]], "not a numpy array"),
        ]
        for tensors, message in bad_inputs:
            with pytest.raises(InvalidTensorsError, match=message):
                await averager.average(tensors, "k", timeout=5)  # type: ignore[arg-type]
        with pytest.raises(ValueError, match="weight"):
            await averager.average([np.zeros(2, np.float32)], "k", weight=float("nan"))
        with pytest.raises(ValueError, match="min_group_size"):
            await averager.average([np.zeros(2, np.float32)], "k", group_size=2, min_group_size=3)
        with pytest.raises(ValueError, match="codec"):
            await averager.average([np.zeros(2, np.float32)], "k", codec="no-such-codec")
        with pytest.raises(ValueError, match="key"):
            await averager.average([np.zeros(2, np.float32)], "k" * 300)


@pytest.mark.timeout(60)
async def test_alone_raises_no_group_within_timeout() -> None:
    async with averager_swarm(1, fast_config(matchmaking_time=0.5)) as swarm:
        started = time.monotonic()
        with pytest.raises(NoGroupError):
            await swarm.peers[0].averager.average([np.zeros(2, np.float32)], "k", timeout=2.0)
        assert time.monotonic() - started < 2.0


@pytest.mark.timeout(90)
async def test_moshpit_grid_16_peers_exact_global_mean() -> None:
    """16 = 4^2 peers, groups of 4, two rounds: every peer ends with the global mean.

    Round 0 groups peers by their initial bits (cell p // 4); each member then shifts in
    a bucket distinct within its group, so round 1 groups take one peer from each
    round-0 group (Moshpit SGD, Ryabinin et al. 2021, section 3.1).
    """
    async with averager_swarm(0) as swarm:
        for p in range(16):
            await swarm.add(fast_config(group_bits=format(p // 4, "02b"), matchmaking_time=5.0))
        values = [np.full(8, float(p), np.float32) for p in range(16)]
        round0 = await asyncio.gather(
            *(
                peer.averager.average([values[p]], "r0", group_size=4, min_group_size=4, timeout=30)
                for p, peer in enumerate(swarm.peers)
            )
        )
        assert len({r.group_id for r in round0}) == 4
        assert any(r.tensors[0][0] != 7.5 for r in round0)  # not mixed yet
        round1 = await asyncio.gather(
            *(
                peer.averager.average(r.tensors, "r1", group_size=4, min_group_size=4, timeout=30)
                for peer, r in zip(swarm.peers, round0, strict=True)
            )
        )
        assert len({r.group_id for r in round1}) == 4
        for r0, r1 in zip(round0, round1, strict=True):
            assert len(set(r0.peers) & set(r1.peers)) == 1  # only itself: groups mixed
        for r in round1:
            np.testing.assert_array_equal(r.tensors[0], np.full(8, 7.5, np.float32))


def test_config_validation() -> None:
    with pytest.raises(ValueError, match="codec"):
        AveragerConfig(default_codec="nope")
    with pytest.raises(ValueError, match="group bits"):
        AveragerConfig(group_bits="2")
    with pytest.raises(ValueError, match="bandwidth"):
        AveragerConfig(bandwidth=-1)
    assert isinstance(AveragingResult, type)
