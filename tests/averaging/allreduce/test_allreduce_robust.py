"""Robust aggregation in real rounds: 4 in-process peers, one sending a huge vector.

The mean is dragged towards the attacker; CenteredClip and the trimmed mean stay within
a bound of the honest mean; every member ends bit-identical whatever the rule, and the
result says which rule ran and how many inputs it adjusted.
"""

from __future__ import annotations

import dataclasses
import threading
from typing import Any

import numpy as np
import pytest

from swarmavg.averaging.aggregation import canonical_aggregation
from swarmavg.averaging.allreduce import reducer
from swarmavg.averaging.allreduce.partition import TensorLayout, flatten
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import (
    FAST,
    close_peers,
    make_group,
    run_group,
    start_peers,
)
from tests.harness import GrpcServerPool

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("allreduce_transport")]

HONEST = 3
RULES = ["mean", "centered-clip", "trimmed-mean", "centered-clip:tau=1.0,iters=10"]


def _flat(tensors: list[np.ndarray]) -> np.ndarray:
    return flatten(tensors, TensorLayout.of(tensors)).astype(np.float64)


def _inputs(dtype: type, attack: float) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(11)
    honest = [
        [
            (rng.standard_normal((40, 50)) + 5.0).astype(dtype),
            rng.standard_normal(1234).astype(dtype),
        ]
        for _ in range(HONEST)
    ]
    attacker = [np.full((40, 50), attack, dtype), np.full(1234, -attack, dtype)]
    return [*honest, attacker]


@pytest.mark.parametrize("rule", RULES)
@pytest.mark.parametrize("dtype", [np.float32, np.float64])
async def test_one_attacker_among_four(
    grpc_servers: GrpcServerPool, channels: ChannelPool, rule: str, dtype: type
) -> None:
    peers = await start_peers(grpc_servers, HONEST + 1)
    try:
        attack = 1e6
        inputs = _inputs(dtype, attack)
        group = dataclasses.replace(
            make_group(peers, inputs[0]), aggregation=canonical_aggregation(rule)
        )
        results = await run_group(peers, group, inputs, [1.0] * (HONEST + 1), channels)
        honest = np.stack([_flat(x) for x in inputs[:HONEST]])
        honest_mean = honest.mean(axis=0)
        spread = np.abs(honest - honest_mean).max()
        for result in results:
            assert isinstance(result, AveragingResult), result
            assert not result.partial
            assert result.aggregation == canonical_aggregation(rule)
            assert all(t.dtype == dtype for t in result.tensors)
            error = np.abs(_flat(result.tensors) - honest_mean).max()
            if rule == "mean":
                assert error > attack / 8  # dragged: a quarter of the attack
                assert result.num_adjusted == 0
            else:
                assert error <= 2 * spread  # bounded by the honest spread, whatever the attack
                assert result.num_adjusted > 0
            assert result.weights_clipped == 0
        for other in results[1:]:
            for a, b in zip(results[0].tensors, other.tensors, strict=True):  # type: ignore[union-attr]
                assert a.tobytes() == b.tobytes()
        if rule.startswith("trimmed-mean"):  # k = 1 per side: 2 values of every coordinate
            total = sum(t.size for t in inputs[0])
            assert all(r.num_adjusted == 2 * total for r in results)  # type: ignore[union-attr]
    finally:
        await close_peers(peers)


@pytest.mark.parametrize("rule", ["centered-clip", "trimmed-mean"])
async def test_robust_rules_equal_the_mean_of_honest_identical_inputs(
    grpc_servers: GrpcServerPool, channels: ChannelPool, rule: str
) -> None:
    """Four honest members that agree: any rule gives their common value, exactly."""
    peers = await start_peers(grpc_servers, 4)
    try:
        value = [np.linspace(-3, 3, 5000, dtype=np.float32)]
        inputs = [[value[0].copy()] for _ in range(4)]
        group = dataclasses.replace(
            make_group(peers, value), aggregation=canonical_aggregation(rule)
        )
        results = await run_group(peers, group, inputs, [1.0, 2.0, 1.0, 0.5], channels)
        for result in results:
            assert isinstance(result, AveragingResult), result
            np.testing.assert_array_equal(result.tensors[0], value[0])
    finally:
        await close_peers(peers)


@pytest.mark.parametrize("rule", ["centered-clip", "trimmed-mean"])
async def test_combination_runs_off_the_event_loop_without_an_executor(
    grpc_servers: GrpcServerPool,
    channels: ChannelPool,
    monkeypatch: pytest.MonkeyPatch,
    rule: str,
) -> None:
    """executor_threads=0 (codec work on the loop, at most 2 cores): a robust rule's
    combination still runs in the service's combiner thread, so the loop goes on moving
    data meanwhile; the result is that of an executor."""
    threads: set[str] = set()
    for name in ("centered_clip", "trimmed_mean"):
        combine = getattr(reducer, name)

        def recording(*args: Any, _combine: Any = combine) -> Any:
            threads.add(threading.current_thread().name)
            return _combine(*args)

        monkeypatch.setattr(reducer, name, recording)
    inputs = _inputs(np.float32, 1e6)
    outcomes = []
    for executor_threads in (0, 2):
        config = dataclasses.replace(FAST, executor_threads=executor_threads)
        peers = await start_peers(grpc_servers, HONEST + 1, config)
        try:
            assert (peers[0].service.executor is None) == (executor_threads == 0)
            group = dataclasses.replace(
                make_group(peers, inputs[0]), aggregation=canonical_aggregation(rule)
            )
            results = await run_group(peers, group, inputs, [1.0] * (HONEST + 1), channels)
            assert all(isinstance(r, AveragingResult) and not r.partial for r in results)
            outcomes.append(results[0])
        finally:
            await close_peers(peers)
        if executor_threads == 0:  # never the loop's thread (the test's own)
            assert threads
            assert all(t.startswith("swarmavg-combine") for t in threads), threads
        threads.clear()
    for a, b in zip(outcomes[0].tensors, outcomes[1].tensors, strict=True):  # type: ignore[union-attr]
        assert a.tobytes() == b.tobytes()
