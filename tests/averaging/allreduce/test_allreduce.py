"""Butterfly all-reduce between in-process peers: exact means, modes, codecs, bit identity."""

from __future__ import annotations

import dataclasses
import threading
import time
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor

import ml_dtypes
import numpy as np
import pytest

from swarmavg.averaging.allreduce import round as round_module
from swarmavg.averaging.allreduce.partition import TensorLayout, flatten
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.allreduce.round import offload
from swarmavg.averaging.allreduce.runner import AllReduceError, run_allreduce
from swarmavg.averaging.group import Mode
from swarmavg.averaging.result import AveragingResult
from swarmavg.compression import known_codecs
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

SHAPES_F32 = [((33, 17), np.float32), ((100,), np.float32), ((), np.float32)]
SHAPES_MIXED = [
    ((3, 5, 7), np.float16),
    ((50,), ml_dtypes.bfloat16),
    ((1,), np.float32),
    ((2000,), np.float32),
    ((0, 4), np.float16),
]
SHAPES_WIDE = [((40, 3), np.float64), ((17,), np.int32), ((9,), np.int8), ((600,), np.float32)]


def _inputs(
    n: int, spec: Sequence[tuple[tuple[int, ...], type]], seed: int = 0
) -> list[list[np.ndarray]]:
    rng = np.random.default_rng(seed)
    out = []
    for _ in range(n):
        tensors = []
        for shape, dtype in spec:
            if np.dtype(dtype).kind in "iu":
                tensors.append(rng.integers(-100, 100, size=shape).astype(dtype))
            else:
                tensors.append((rng.standard_normal(shape) * 3).astype(dtype))
        out.append(tensors)
    return out


def _flat(tensors: Sequence[np.ndarray]) -> np.ndarray:
    layout = TensorLayout.of(tensors)
    return flatten(tensors, layout).astype(np.float64)


def _expected(inputs: list[list[np.ndarray]], weights: Sequence[float], senders: Sequence[int]):
    return weighted_mean([_flat(inputs[i]) for i in senders], [weights[i] for i in senders])


def _assert_close_to(outcome: AveragingResult, expected: np.ndarray, like: Sequence[np.ndarray]):
    layout = TensorLayout.of(like)
    for out, ref, offset, shape, dtype in zip(
        outcome.tensors, like, layout.offsets, layout.shapes, layout.dtypes, strict=True
    ):
        assert out.dtype == ref.dtype
        assert out.shape == ref.shape
        want = expected[offset : offset + out.size].reshape(shape)
        if dtype.kind in "iu":
            np.testing.assert_array_less(np.abs(out.astype(np.float64) - want), 0.5 + 1e-6)
        else:
            eps = float(ml_dtypes.finfo(dtype).eps)
            np.testing.assert_allclose(out.astype(np.float64), want, rtol=2 * eps, atol=4 * eps)


def _assert_bit_identical(outcomes: Sequence[AveragingResult]) -> None:
    for other in outcomes[1:]:
        for a, b in zip(outcomes[0].tensors, other.tensors, strict=True):
            assert a.tobytes() == b.tobytes()


CASES = {
    "2-nodes": ([Mode.NODE, Mode.NODE], [1.0, 3.0], None),
    "node-client-aux": ([Mode.NODE, Mode.CLIENT, Mode.AUX], [2.0, 1.0, 0.0], None),
    "5-mixed-bandwidth": (
        [Mode.NODE, Mode.NODE, Mode.CLIENT, Mode.NODE, Mode.AUX],
        [1.0, 0.0, 2.0, 1.5, 0.0],
        [1.0, 3.0, 0.0, 0.0, 2.0],
    ),
    "8-nodes": ([Mode.NODE] * 8, [1.0, 0.0, 2.0, 0.5, 1.0, 3.0, 0.25, 1.0], None),
}


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize(
    "spec", [SHAPES_F32, SHAPES_MIXED, SHAPES_WIDE], ids=["f32", "f16-bf16-f32", "f64-int"]
)
async def test_exact_weighted_mean(
    grpc_servers: GrpcServerPool,
    channels: ChannelPool,
    case: str,
    spec: list[tuple[tuple[int, ...], type]],
) -> None:
    modes, weights, bandwidths = CASES[case]
    n = len(modes)
    peers = await start_peers(grpc_servers, n)
    try:
        inputs = _inputs(n, spec)
        if Mode.AUX in modes:  # aux members pass tensors of the schema; they are not sent
            aux = modes.index(Mode.AUX)
            inputs[aux] = [np.full_like(t, 99) for t in inputs[aux]]
        before = [[t.copy() for t in tensors] for tensors in inputs]
        group = make_group(peers, inputs[0], modes, bandwidths)
        results = await run_group(peers, group, inputs, weights, channels)
        senders = [i for i, m in enumerate(modes) if m is not Mode.AUX]
        expected = _expected(inputs, weights, senders)
        outcomes = []
        for i, result in enumerate(results):
            assert isinstance(result, AveragingResult), result
            if modes[i] is Mode.AUX:
                continue
            assert not result.partial
            assert result.failed_parts == ()
            _assert_close_to(result, expected, inputs[0])
            outcomes.append(result)
        _assert_bit_identical(outcomes)
        for tensors, saved in zip(inputs, before, strict=True):
            for t, s in zip(tensors, saved, strict=True):
                assert t.tobytes() == s.tobytes()
    finally:
        await close_peers(peers)


@pytest.mark.parametrize(("n", "total"), [(3, 3), (5, 3), (4, 1)])
async def test_parts_of_a_single_element(
    grpc_servers: GrpcServerPool, channels: ChannelPool, n: int, total: int
) -> None:
    peers = await start_peers(grpc_servers, n)
    try:
        inputs = [[np.arange(total, dtype=np.float32) * (i + 1)] for i in range(n)]
        weights = [float(i % 3) for i in range(n)]
        group = make_group(peers, inputs[0])
        results = await run_group(peers, group, inputs, weights, channels)
        expected = _expected(inputs, weights, range(n))
        for r in results:
            assert isinstance(r, AveragingResult), r
            assert not r.partial
            _assert_close_to(r, expected, inputs[0])
        _assert_bit_identical(results)  # type: ignore[arg-type]
    finally:
        await close_peers(peers)


LOSSY = [c for c in known_codecs() if c != "none" and "<" not in c] + ["zstd+float16"]
# Max error relative to the inputs' largest magnitude: two quantisations (the sender's
# copy and the reducer's average), each within half a step of the codec's grid.
ERROR_BOUND = {
    "float16": 2e-3,
    "bfloat16": 2e-2,
    "scaled-float16": 2e-3,
    "uint8-uniform": 0.02,
    "uint8-blockwise": 0.02,
    "uint8-quantile": 0.1,
    "uint4-blockwise": 0.2,
}


@pytest.mark.parametrize("codec", LOSSY)
async def test_codecs_give_bit_identical_results_within_bound(
    grpc_servers: GrpcServerPool, channels: ChannelPool, codec: str
) -> None:
    n = 4
    peers = await start_peers(grpc_servers, n)
    try:
        inputs = _inputs(n, [((5000,), np.float32), ((64, 8), np.float32)], seed=3)
        weights = [1.0, 2.0, 0.5, 1.0]
        group = make_group(peers, inputs[0], codec=codec)
        results = await run_group(peers, group, inputs, weights, channels)
        expected = _expected(inputs, weights, range(n))
        for r in results:
            assert isinstance(r, AveragingResult), r
            assert not r.partial
            got = _flat(r.tensors)
            assert np.isfinite(got).all()
            if codec in ERROR_BOUND:  # sparsifying codecs (top-k) are not near the mean
                scale = max(np.abs(_flat(x)).max() for x in inputs)
                assert np.abs(got - expected).max() <= ERROR_BOUND[codec] * scale
        _assert_bit_identical(results)  # type: ignore[arg-type]
    finally:
        await close_peers(peers)


async def test_two_rounds_reuse_the_service_and_channels(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    peers = await start_peers(grpc_servers, 3)
    try:
        for seed in range(2):
            inputs = _inputs(3, SHAPES_F32, seed=seed)
            group = make_group(peers, inputs[0])
            results = await run_group(peers, group, inputs, [1.0, 1.0, 1.0], channels)
            expected = _expected(inputs, [1.0] * 3, range(3))
            for r in results:
                assert isinstance(r, AveragingResult), r
                _assert_close_to(r, expected, inputs[0])
        if peers[0].data_port:  # one connection per (sender, reducer), reused by round 2
            opened = [p.service.data_connector.opened for p in peers if p.service.data_connector]
            assert opened == [2, 2, 2]
            assert len(channels) == 0
        else:
            assert len(channels) == 3
    finally:
        await close_peers(peers)


async def test_input_validation(grpc_servers: GrpcServerPool, channels: ChannelPool) -> None:
    peers = await start_peers(grpc_servers, 2)
    try:
        inputs = _inputs(2, SHAPES_F32)
        group = make_group(peers, inputs[0])
        service, signer = peers[0].service, peers[0].signer
        soon = time.monotonic() + 5

        async def run(tensors: list[np.ndarray], weight: float = 1.0, index: int = 0) -> None:
            await run_allreduce(
                group,
                index,
                tensors,
                weight,
                deadline=soon,
                service=service,
                channels=channels,
                signer=signer,
            )

        with pytest.raises(ValueError, match="schema"):
            await run([t.astype(np.float64) for t in inputs[0]])
        with pytest.raises(ValueError, match="schema"):
            await run(inputs[0][:2])
        bad = [t.copy() for t in inputs[0]]
        bad[0][0, 0] = np.nan
        with pytest.raises(ValueError, match="NaN"):
            await run(bad)
        with pytest.raises(ValueError, match="weight"):
            await run(inputs[0], weight=-1.0)
        with pytest.raises(ValueError, match="peer id"):
            await run(inputs[0], index=1)
        with pytest.raises(AllReduceError, match="deadline"):
            await run_allreduce(
                group,
                0,
                inputs[0],
                1.0,
                deadline=time.monotonic() - 1,
                service=service,
                channels=channels,
                signer=signer,
            )
    finally:
        await close_peers(peers)


async def test_inline_codec_work_gives_the_same_bits(
    grpc_servers: GrpcServerPool, channels: ChannelPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """executor_threads=0 (codecs on the loop), or small chunks coded on the loop beside an
    executor, change where work runs, not the result."""
    inputs = _inputs(3, SHAPES_MIXED, seed=9)
    weights = [1.0, 0.5, 2.0]
    outcomes = []
    for threads, inline_elements in ((2, 0), (2, round_module.INLINE_ELEMENTS), (0, 0)):
        monkeypatch.setattr(round_module, "INLINE_ELEMENTS", inline_elements)
        config = dataclasses.replace(FAST, executor_threads=threads)
        peers = await start_peers(grpc_servers, 3, config)
        try:
            group = make_group(peers, inputs[0], codec="float16")
            results = await run_group(peers, group, inputs, weights, channels)
            assert all(isinstance(r, AveragingResult) and not r.partial for r in results)
            outcomes.append(results[0])
        finally:
            await close_peers(peers)
    _assert_bit_identical(outcomes)  # type: ignore[arg-type]


async def test_small_work_runs_on_the_loop_and_large_work_in_the_executor() -> None:
    loop_thread = threading.current_thread().name
    with ThreadPoolExecutor(1, thread_name_prefix="worker") as executor:

        async def where(elements: int | None) -> str:
            return await offload(
                executor, lambda: threading.current_thread().name, elements=elements
            )

        assert await where(round_module.INLINE_ELEMENTS - 1) == loop_thread
        assert (await where(round_module.INLINE_ELEMENTS)).startswith("worker")
        assert (await where(None)).startswith("worker")  # unknown size: the executor
    assert await offload(None, lambda: threading.current_thread().name) == loop_thread


async def test_topk_error_feedback_carries_across_rounds(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    """Over many rounds of the same inputs, the sum of top-k averages tracks the true sum.

    Each sender keeps its residuals in the daemon's codec instance, so every element is sent
    eventually; with residuals dropped between rounds the small elements would never move.
    """
    peers = await start_peers(grpc_servers, 2)
    rng = np.random.default_rng(7)
    inputs = [[rng.standard_normal(2000).astype(np.float32)] for _ in range(2)]
    expected = (inputs[0][0] + inputs[1][0]) / 2
    rounds = 60
    total = np.zeros_like(expected)
    try:
        for _ in range(rounds):
            group = make_group(peers, inputs[0], codec="topk:fraction=0.05")
            results = await run_group(peers, group, inputs, [1.0, 1.0], channels)
            assert isinstance(results[0], AveragingResult), results[0]
            total += results[0].tensors[0]
    finally:
        await close_peers(peers)
    # Without error feedback 95% of the elements would stay near 0 in every round.
    relative = np.linalg.norm(total / rounds - expected) / np.linalg.norm(expected)
    assert relative < 0.25, relative
