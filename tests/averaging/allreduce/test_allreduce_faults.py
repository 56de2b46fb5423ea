"""The fault matrix: one member of four stalls, stops, crashes or never comes.

Faults are injected through the runner's seam (:class:`FaultPlan`); the survivors must
return in time with the exact mean of the contributions that reached each live reducer,
bit-identical across survivors, ``partial=True``, and their inputs untouched.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading
import time

import numpy as np
import pytest

from swarmavg.averaging.allreduce import round as round_module
from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.faults import Fault, FaultPlan, InjectedCrash
from swarmavg.averaging.allreduce.load_balancing import part_sizes
from swarmavg.averaging.allreduce.partition import PartPlan
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.result import AveragingResult
from swarmavg.compression.base import Buffer, Header
from swarmavg.compression.floating import Float16Codec
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import FAST, close_peers, make_group, run_group, start_peers
from tests.harness import GrpcServerPool

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("allreduce_transport")]

N = 4
FAULTY = 1
SIZE = 9000  # 4 parts of 2250 elements: chunks of 1024, 1024, 202
TIMEOUT = 2.0  # a silent reducer is waited out to it: ample for 9000 floats in one process
GRACE = 3.0
WEIGHTS = [1.0, 2.0, 0.5, 1.5]


def _chunks(group_members: tuple, chunk_elements: int = 1024) -> PartPlan:  # type: ignore[type-arg]
    return PartPlan.build(part_sizes(group_members, SIZE), chunk_elements)


# fault -> (plan or None for "never starts", chunks of live parts the faulty one delivers
#           (None: any prefix, nondeterministic), expected failed parts)
FAULTS: dict[str, tuple[FaultPlan | None, int | None, set[int] | None]] = {
    "stop-sending-at-start": (FaultPlan(Fault.STOP_SENDING, 0), 0, set()),
    "stop-sending-midway": (FaultPlan(Fault.STOP_SENDING, 2), 2, set()),
    "stop-reducing-at-start": (FaultPlan(Fault.STOP_REDUCING, 0), 3, {FAULTY}),
    "stop-reducing-midway": (FaultPlan(Fault.STOP_REDUCING, 2), 3, {FAULTY}),
    "crash-at-start": (FaultPlan(Fault.CRASH, 0), 0, {FAULTY}),
    "crash-midway": (FaultPlan(Fault.CRASH, 2), None, None),
    "never-starts": (None, 0, {FAULTY}),
}


@pytest.mark.parametrize("fault", list(FAULTS))
async def test_survivors_finish_with_the_mean_of_what_arrived(
    grpc_servers: GrpcServerPool, channels: ChannelPool, fault: str
) -> None:
    plan_, delivered, expected_failed = FAULTS[fault]
    peers = await start_peers(grpc_servers, N)
    try:
        rng = np.random.default_rng(11)
        inputs = [[rng.standard_normal(SIZE).astype(np.float32)] for _ in range(N)]
        saved = [x[0].copy() for x in inputs]
        group = make_group(peers, inputs[0])
        plan = _chunks(group.members)
        survivors = [i for i in range(N) if i != FAULTY]
        full = weighted_mean([x[0] for x in inputs], WEIGHTS)
        partial_mean = weighted_mean(
            [inputs[i][0] for i in survivors], [WEIGHTS[i] for i in survivors]
        )

        started = time.monotonic()
        results = await run_group(
            peers,
            group,
            inputs,
            WEIGHTS,
            channels,
            timeout=TIMEOUT,
            faults={FAULTY: plan_} if plan_ is not None else {},
            skip=[FAULTY] if plan_ is None else [],
        )
        elapsed = time.monotonic() - started
        assert elapsed <= TIMEOUT + GRACE

        if plan_ is None:
            assert results[FAULTY] is None
        elif plan_.fault is Fault.CRASH:
            assert isinstance(results[FAULTY], InjectedCrash)
        else:
            assert isinstance(results[FAULTY], AveragingResult)
            assert results[FAULTY].partial  # type: ignore[union-attr]

        outcomes = [results[i] for i in survivors]
        for i, r in zip(survivors, outcomes, strict=True):
            assert isinstance(r, AveragingResult), r
            assert r.partial
            if expected_failed is not None:
                assert set(r.failed_parts) == expected_failed
            else:
                assert set(r.failed_parts) <= {FAULTY}
            got = r.tensors[0]
            for part in range(N):
                base = plan.bounds[part][0]
                for c in range(plan.num_chunks(part)):
                    lo, hi = plan.chunk_bounds(part, c)
                    sl = slice(base + lo, base + hi)
                    candidates = {
                        "full": full[sl],
                        "survivors": partial_mean[sl],
                        "local": saved[i][sl],
                    }
                    close = {
                        k
                        for k, v in candidates.items()
                        if np.allclose(got[sl], v, rtol=1e-5, atol=1e-6)
                    }
                    if part == FAULTY:
                        assert close, (part, c)
                        continue
                    if delivered is None:
                        assert close & {"full", "survivors"}, (part, c)
                    else:
                        want = "full" if c < delivered else "survivors"
                        assert want in close, (part, c, close)
        # Every part whose reducer lived is bit-identical across survivors.
        for part in range(N):
            if part == FAULTY:
                continue
            lo, hi = plan.bounds[part]
            ref = outcomes[0].tensors[0][lo:hi].tobytes()  # type: ignore[union-attr]
            for r in outcomes[1:]:
                assert r.tensors[0][lo:hi].tobytes() == ref  # type: ignore[union-attr]
        for x, s in zip(inputs, saved, strict=True):
            assert x[0].tobytes() == s.tobytes()
    finally:
        await close_peers(peers)


async def test_the_deadline_bounds_a_stalled_round(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    """With stall detection effectively off, only the round deadline ends a stalled round."""
    patient = AllReduceConfig(min_stall=1000.0, registration_wait=2.0, chunk_bytes=4096)
    peers = await start_peers(grpc_servers, 3, patient)
    try:
        rng = np.random.default_rng(5)
        inputs = [[rng.standard_normal(SIZE).astype(np.float32)] for _ in range(3)]
        saved = [x[0].copy() for x in inputs]
        group = make_group(peers, inputs[0])
        timeout = 3.0
        started = time.monotonic()
        results = await run_group(
            peers,
            group,
            inputs,
            [1.0, 1.0, 1.0],
            channels,
            timeout=timeout,
            faults={2: FaultPlan(Fault.STOP_SENDING, 1)},
        )
        assert time.monotonic() - started <= timeout + GRACE
        plan = _chunks(group.members)
        for i, r in enumerate(results):
            assert isinstance(r, AveragingResult), r
            assert r.partial
            # Chunk 0 of part 0 was delivered by everyone: averaged. The later chunks
            # waited for member 2 until the reducers' deadline, then averaged the others.
            lo, hi = plan.chunk_bounds(0, 0)
            np.testing.assert_allclose(
                r.tensors[0][lo:hi],
                np.mean([x[0][lo:hi] for x in inputs], axis=0),
                rtol=1e-5,
                atol=1e-6,
            )
            assert inputs[i][0].tobytes() == saved[i].tobytes()
    finally:
        await close_peers(peers)


def test_fast_config_is_what_the_matrix_assumes() -> None:
    assert FAST.chunk_bytes == 4096  # 1024-element chunks of float32 with codec "none"


class _StalledReplyDecoder(Float16Codec):
    """float16 whose first reply decode blocks until released: a decode still running in
    an executor thread when the round's deadline passes."""

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.done = threading.Event()
        self.released = False
        self._first = threading.Lock()

    def _stall_first(self) -> bool:
        """Whether this is the first reply decode, after waiting for its release."""
        if not self._first.acquire(blocking=False):
            return False
        self.released = self.release.wait(30)
        return True

    # A member decodes a reply straight into the result, or (the part check on) decodes it
    # first and copies it under the result's lock: the first decode stalls either way.
    def decode_payload_into(self, header: Header, payload: Buffer, out: np.ndarray) -> None:
        first = self._stall_first()
        super().decode_payload_into(header, payload, out)
        if first:
            self.done.set()

    def decode_payload(self, header: Header, payload: Buffer) -> np.ndarray:
        first = self._stall_first()
        try:
            return super().decode_payload(header, payload)
        finally:
            if first:
                self.done.set()


async def test_a_reply_decoded_after_the_deadline_cannot_change_the_result(
    grpc_servers: GrpcServerPool, channels: ChannelPool, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Replies decode straight into the result in executor threads, which a cancelled
    round cannot stop: the round must not hand out a result such a thread still writes."""
    # Chunks this small are decoded on the loop; the threads take the large ones.
    monkeypatch.setattr(round_module, "INLINE_ELEMENTS", 0)
    config = dataclasses.replace(FAST, executor_threads=4)
    peers = await start_peers(grpc_servers, 2, config)
    stalled = _StalledReplyDecoder()
    peers[0].service._codecs["float16"] = stalled  # the service's per-name codec instance
    try:
        rng = np.random.default_rng(5)
        inputs = [[rng.standard_normal(SIZE).astype(np.float32)] for _ in range(2)]
        group = make_group(peers, inputs[0], codec="float16")
        timeout = 2.0
        # Released only after member 0's deadline: its round ends with the decode running.
        asyncio.get_running_loop().call_later(timeout + 0.5, stalled.release.set)
        results = await run_group(peers, group, inputs, [1.0, 1.0], channels, timeout=timeout)
        outcome = results[0]
        assert isinstance(outcome, AveragingResult), outcome
        assert outcome.partial
        handed_out = outcome.tensors[0].copy()
        assert await asyncio.to_thread(stalled.done.wait, 10)
        # The event loop's timer released it: ending the round never blocks the loop on a
        # decode that is still running in a thread (it waited 30 s for it once).
        assert stalled.released
        # The late decode finished before the round returned, or never wrote: either way
        # the tensors the caller holds do not change afterwards.
        np.testing.assert_array_equal(outcome.tensors[0], handed_out)
        # Part 1 (averaged by member 1) was never received by member 0: its local values.
        lo, hi = _chunks(group.members).bounds[1]
        np.testing.assert_array_equal(handed_out[lo:hi], inputs[0][0][lo:hi])
    finally:
        stalled.release.set()
        await close_peers(peers)
