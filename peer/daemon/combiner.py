"""Combining the training processes of one machine into one contribution per round.

Several training processes (one per GPU) that call ``average`` with the same key at about
the same time join one *local batch*. The batch contributes ``sum(w_i * x_i) / W`` with
weight ``W = sum(w_i)`` to the swarm's round, so the swarm sees one peer and the weighted
mean over everyone stays exact. Every local caller receives the round's result.

How long a batch waits: a batch closes as soon as it holds as many callers as the largest
of the last few batches did, or after ``window`` seconds at the latest. Every client sends
a random ``client_id``; a batch that holds a client's first call always waits the whole
window (the daemon cannot know yet how many processes there are). So a single training
process waits once, on its first call, and N processes on N GPUs wait only for each other;
when one of them stops, batches wait the window until the history forgets it.

A caller that goes away (its client was killed) simply stops waiting: a batch whose
window is still open drops it; a round already under way continues for the others.
"""

from __future__ import annotations

import asyncio
import collections
import contextlib
import dataclasses
from collections.abc import Awaitable
from dataclasses import dataclass, field
from typing import Protocol

import numpy as np

from swarmavg.averaging.request import RoundRequest, check_finite
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht.tasks import TaskSet
from swarmavg.peer.client.errors import DaemonUnavailableError, ValidationError
from swarmavg.peer.client.validation import same_layout


class AverageFn(Protocol):
    """One swarm round (``Peer._average``): ``out`` receives the result when given."""

    def __call__(
        self,
        arrays: list[np.ndarray],
        request: RoundRequest,
        *,
        out: list[np.ndarray] | None = None,
        inputs_ready: Awaitable[object] | None = None,
        checked_by_client: bool = False,
    ) -> Awaitable[AveragingResult]: ...


@dataclass
class _Member:
    arrays: list[np.ndarray]
    request: RoundRequest
    future: asyncio.Future[AveragingResult]
    out: list[np.ndarray] | None = None
    ready: Awaitable[object] | None = None
    checked_by_client: bool = False  # its client checked it, not this daemon (yet)


@dataclass
class _Batch:
    key: str
    full: asyncio.Event
    members: list[_Member] = field(default_factory=list)
    has_newcomer: bool = False


def combine(arrays_per_member: list[list[np.ndarray]], weights: list[float]) -> list[np.ndarray]:
    """``sum(w_i * x_i) / sum(w_i)`` per tensor, reduced in fp32 (fp64 for fp64 input)
    and cast back to the input dtype so the swarm sees the same schema from every peer."""
    total = float(sum(weights))
    out: list[np.ndarray] = []
    for index, first in enumerate(arrays_per_member[0]):
        acc_dtype = np.float64 if first.dtype == np.float64 else np.float32
        acc = np.zeros(first.shape, dtype=acc_dtype)
        for arrays, weight in zip(arrays_per_member, weights, strict=True):
            term: np.ndarray = arrays[index].astype(acc_dtype, copy=False)
            acc += term * np.asarray(weight / total, dtype=acc_dtype)
        out.append(acc.astype(first.dtype))
    return out


class LocalCombiner:
    """Batches same-key local calls and runs one swarm round per batch.

    Owns one task per open batch; :meth:`close` cancels them and fails their callers.
    """

    HISTORY = 3
    """How many recent batch sizes decide how many callers a batch waits for."""
    MAX_KNOWN_CLIENTS = 4096

    def __init__(self, average: AverageFn, window: float) -> None:
        self._average = average
        self._window = window
        self._known: dict[str, None] = {}  # client ids seen, oldest first
        self._recent_sizes: collections.deque[int] = collections.deque(maxlen=self.HISTORY)
        self._open: dict[str, _Batch] = {}
        self._tasks = TaskSet()
        self._closed = False

    def expected_callers(self) -> int:
        """How many local callers a batch waits for: the most of the recent batches."""
        return max(self._recent_sizes, default=1)

    async def submit(
        self,
        arrays: list[np.ndarray],
        request: RoundRequest,
        client_id: str = "",
        out: list[np.ndarray] | None = None,
        inputs_ready: Awaitable[object] | None = None,
        checked_by_client: bool = False,
    ) -> AveragingResult:
        """Join (or open) the batch for ``request.key`` and wait for the round's outcome.

        Args:
            arrays: the caller's tensors (checked, or being checked: ``inputs_ready``).
            request: the caller's round parameters (checked).
            client_id: the calling client's id ("" counts as one anonymous caller).
            out: where the caller wants the result (its shared memory); used when it is
                the batch's only caller, so the round writes there directly. The
                result's tensors are then these arrays.
            inputs_ready: the copy and check of ``arrays`` still running: a batch of
                one hands it to the round (matchmaking overlaps it), a larger batch
                waits for it before combining and leaves out a caller whose check failed.
            checked_by_client: ``arrays`` were checked by the caller's client, which
                says so, and not here: a batch of one hands that on to the round (which
                checks each chunk as it encodes it), a larger batch checks them before
                combining and leaves the caller out if they hold NaN/Inf.

        Raises:
            ValidationError: the tensors differ in layout from the batch's other callers.
            DaemonUnavailableError: the daemon is shutting down.
            Exception: whatever the round raised.
        """
        if self._closed:
            raise DaemonUnavailableError("the daemon is shutting down")
        loop = asyncio.get_running_loop()
        newcomer = client_id not in self._known
        if newcomer:
            self._known[client_id] = None
            if len(self._known) > self.MAX_KNOWN_CLIENTS:
                del self._known[next(iter(self._known))]
        batch = self._open.get(request.key)
        if batch is None:
            batch = _Batch(request.key, asyncio.Event())
            self._open[request.key] = batch
            self._tasks.spawn(self._run(batch), name=f"local-batch:{request.key}")
        else:
            difference = same_layout(batch.members[0].arrays, arrays)
            if difference is None and batch.members[0].request.aggregation != request.aggregation:
                difference = (
                    f"aggregation {request.aggregation!r}, not "
                    f"{batch.members[0].request.aggregation!r}"
                )
            if difference is not None:
                raise ValidationError(
                    f"tensors for key {request.key!r} differ from those another local "
                    f"process is averaging: {difference}"
                )
        member = _Member(
            arrays, request, loop.create_future(), out, inputs_ready, checked_by_client
        )
        batch.members.append(member)
        batch.has_newcomer |= newcomer
        if not batch.has_newcomer and len(batch.members) >= self.expected_callers():
            batch.full.set()
        return await member.future

    async def _run(self, batch: _Batch) -> None:
        try:
            try:
                # Closed as soon as every recently seen local process joined, else after
                # the window; a lone training process does not wait at all.
                with contextlib.suppress(TimeoutError):
                    await asyncio.wait_for(batch.full.wait(), self._window)
            finally:
                if self._open.get(batch.key) is batch:
                    del self._open[batch.key]
            members = [m for m in batch.members if not m.future.done()]
            if not members:
                return
            self._recent_sizes.append(len(members))
            if len(members) > 1:
                members = await _checked(members)
                if not members:
                    return
            outcome = await self._round(members)
        except asyncio.CancelledError:
            _fail(batch.members, DaemonUnavailableError("the daemon is shutting down"))
            raise
        except Exception as exc:
            _fail(batch.members, exc)
            return
        for m in members:
            if not m.future.done():
                m.future.set_result(outcome)

    async def _round(self, members: list[_Member]) -> AveragingResult:
        # The batch takes its first caller's parameters, the sum of the weights and the
        # earliest deadline, so no caller waits past its own timeout.
        request = members[0].request
        out = None
        ready = None
        by_client = False
        if len(members) == 1:
            arrays, out, ready = members[0].arrays, members[0].out, members[0].ready
            by_client = members[0].checked_by_client
        else:
            weights = [m.request.weight for m in members]
            arrays = await asyncio.to_thread(combine, [m.arrays for m in members], weights)
            request = dataclasses.replace(
                request,
                weight=float(sum(weights)),
                deadline=min(m.request.deadline for m in members),
            )
        if out is None and ready is None and not by_client:
            result = await self._average(arrays, request)
        else:
            result = await self._average(
                arrays, request, out=out, inputs_ready=ready, checked_by_client=by_client
            )
        return dataclasses.replace(result, local_callers=len(members))

    async def close(self) -> None:
        """Cancel open batches and rounds (their callers get ``DaemonUnavailableError``)."""
        self._closed = True
        await self._tasks.close()
        for batch in self._open.values():
            _fail(batch.members, DaemonUnavailableError("the daemon is shutting down"))
        self._open.clear()


async def _checked(members: list[_Member]) -> list[_Member]:
    """The members whose inputs passed their check; the others get its exception.

    Inputs that only their client checked are checked here: a NaN in one caller's tensors
    would otherwise reach the others' results through the combined contribution."""
    kept = []
    for m in members:
        try:
            if m.ready is not None:
                await m.ready
            elif m.checked_by_client:
                await asyncio.to_thread(check_finite, m.arrays)
        except Exception as exc:
            if not m.future.done():
                m.future.set_exception(exc)
            continue
        m.ready = None  # checked: nothing left to wait for
        m.checked_by_client = False
        kept.append(m)
    return kept


def _fail(members: list[_Member], exc: BaseException) -> None:
    for m in members:
        if not m.future.done():
            m.future.set_exception(exc)
