"""The butterfly all-reduce runner: one member's side of one round (docs/averaging.md).

Given a formed :class:`~swarmavg.averaging.group.GroupInfo`, every member flattens its
tensors (:mod:`~swarmavg.averaging.allreduce.partition`), cuts the vector into one part per
reducing member sized by bandwidth (:mod:`~swarmavg.averaging.allreduce.load_balancing`), streams
its chunks of part ``j`` to member ``j`` over one ``Reduce`` stream, and writes the
averaged chunks that come back into its result. Its own part is reduced locally by a
:class:`~swarmavg.averaging.allreduce.service.ReducerRound` that the inbound streams of the
other members feed.

Pipelining: the sender encodes chunk ``c + 1`` while chunk ``c`` is on the wire, reads
averaged chunks while it writes (one send task and one receive loop per stream), and
the reducer returns every chunk as soon as all live senders delivered it.

Failure (the reason this module exists): every wait has a deadline derived from the
round's deadline and the observed progress. A stalled or broken sender is dropped by
the reducer, whose part then averages the others; a reducer that dies or stalls leaves
the chunks it did not return with this member's local values and ``partial=True``. The
runner returns by ``deadline`` (plus the time to cancel its streams) and never mutates
the caller's tensors, unless the caller asks for the result in place (``out`` is
``tensors``: the daemon does, for a client's shared memory).

Honest reporting: what a member reports comes from what it observed itself,
not from the reducers' word. A reducer that answers inconsistently is distrusted for its
whole part: the part keeps this member's local values, counts as not averaged
(``failed_parts``, ``distrusted``) and makes the result partial.

The runner owns the round's phases; each concept has its module: what this member sends
(:mod:`~swarmavg.averaging.allreduce.outgoing`), its streams to the other reducers
(:mod:`~swarmavg.averaging.allreduce.streams`), what comes back and whether to trust it
(:mod:`~swarmavg.averaging.allreduce.replies`), where the result lives
(:mod:`~swarmavg.averaging.allreduce.memory`), and its own part's reducer
(:mod:`~swarmavg.averaging.allreduce.round`).

API (used by ``swarmavg.averaging.averager``)::

    service = AllReduceService(node.authenticator)  # once per daemon, inside the loop
    result = await run_allreduce(group, my_index, tensors, weight,
                                 deadline=time.monotonic() + 30,
                                 service=service, channels=pool, signer=node.signer)
"""

from __future__ import annotations

import asyncio
import enum
import logging
import math
import time
from collections.abc import Sequence

import grpc
import numpy as np

from swarmavg.averaging.aggregation import MEAN
from swarmavg.averaging.allreduce.buffers import BufferPool
from swarmavg.averaging.allreduce.chunking import bytes_per_element, link_chunk_bytes
from swarmavg.averaging.allreduce.faults import FaultPlan, InjectedCrash
from swarmavg.averaging.allreduce.load_balancing import part_sizes
from swarmavg.averaging.allreduce.member_side import MemberSide
from swarmavg.averaging.allreduce.memory import aligned_like, result_target
from swarmavg.averaging.allreduce.outgoing import Contribution
from swarmavg.averaging.allreduce.partition import (
    PartPlan,
    TensorLayout,
    chunk_elements_for,
    flat_view,
    flatten,
    unflatten,
)
from swarmavg.averaging.allreduce.replies import ResultAssembly
from swarmavg.averaging.allreduce.round import Abort, ReducerRound, offload
from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.averaging.allreduce.streams import ChannelSource, PartStreams
from swarmavg.averaging.group import GroupInfo, schema_hash
from swarmavg.averaging.result import AveragingResult
from swarmavg.compression import Codec
from swarmavg.compression.kernels import all_finite
from swarmavg.dht.auth import RequestSigner

log = logging.getLogger(__name__)

__all__ = [
    "AllReduceError",
    "AllReduceService",
    "ChannelSource",
    "FiniteCheck",
    "run_allreduce",
]


class AllReduceError(RuntimeError):
    """The round could not run at all (e.g. its deadline had already passed)."""


class FiniteCheck(enum.Enum):
    """Where a member's tensors are checked for NaN/Inf, which would poison the group."""

    UPFRONT = "upfront"
    """:func:`run_allreduce` scans them whole before it sends anything."""
    DONE = "done"
    """The caller scanned them already (the ``Averager`` does, before matchmaking)."""
    AS_ENCODED = "as-encoded"
    """For inputs whose writer checked them and says so (a client's shared memory): no scan
    here. Each chunk is checked by the codec as it encodes it (fused into its pass for the
    lossy codecs), and with ``none`` under the mean where the values are checked anyway:
    by the reducer that decodes a chunk, or, for our own part, by our reducer as it
    encodes each average. A bad chunk fails the call with :class:`InvalidTensorsError`:
    at once when the codec finds it, at the end of the round when a reducer refused it
    and it kept our values. Only a caller that lied gets that error, after its group
    formed, and the group then goes on without it (or without the chunks it spoiled)."""


async def run_allreduce(
    group: GroupInfo,
    my_index: int,
    tensors: Sequence[np.ndarray],
    weight: float,
    *,
    deadline: float,
    service: AllReduceService,
    channels: ChannelSource,
    signer: RequestSigner,
    fault_plan: FaultPlan | None = None,
    finite_check: FiniteCheck = FiniteCheck.UPFRONT,
    out: Sequence[np.ndarray] | None = None,
) -> AveragingResult:
    """Run this member's side of one butterfly all-reduce round.

    Args:
        group: the formed group (identical on every member).
        my_index: this member's position in ``group.members``.
        tensors: this member's tensors (never modified). ``AUX`` members pass arrays of
            the group's schema too (e.g. zeros); their values are not sent.
        weight: this member's weight, finite and >= 0 (ignored for ``AUX``).
        deadline: absolute ``time.monotonic()`` by which the round ends.
        service: this daemon's :class:`AllReduceService` (serves our part).
        channels: a channel pool (``swarmavg.dht.ChannelPool``).
        signer: signs this peer's stream openings (``DHTNode.signer``).
        fault_plan: test seam; ``None`` in production.
        finite_check: where the tensors are checked for NaN/Inf (:class:`FiniteCheck`):
            here before anything is sent (the default), already by the caller, or chunk
            by chunk as the codec encodes them.
        out: arrays of the tensors' layout (writable, not overlapping ``tensors``) that
            receive the result; the result's ``tensors`` are then these arrays. When they
            lie back to back in the reduction dtype (one float32 tensor, say) the replies
            are decoded straight into them: no fresh result buffer, no copy afterwards.
            ``out`` may also be ``tensors`` themselves (the same memory): the round then
            averages in place, and a chunk no reducer returned keeps its values. (With the
            part check off, a reducer distrusted mid-part leaves the chunks it returned
            before averaged, see ``ResultAssembly.distrust``.) ``None``: the result goes into
            new arrays.

    Returns:
        The outcome; ``partial`` when a member failed mid-round.

    Raises:
        ValueError: the tensors do not match ``group.schema_hash``, hold NaN/Inf, the
            weight is invalid, ``my_index``/``signer`` do not name a member, or ``out``
            has another layout, is read-only or overlaps ``tensors``.
        InvalidTensorsError: (a ``ValueError``) with ``FiniteCheck.AS_ENCODED``, a chunk
            of the tensors held NaN/Inf; the round stopped when it was found, and the
            group goes on without this member.
        AllReduceError: the deadline has already passed.
        InjectedCrash: only when ``fault_plan`` says so.
    """
    t0 = time.monotonic()
    _check_arguments(group, my_index, tensors, weight, deadline, signer, t0)
    me = group.members[my_index]
    layout = TensorLayout.of(tensors)
    target = result_target(out, tensors, layout)
    codec = service.codec(group.codec)
    executor = service.executor
    plan = await _plan_parts(group, layout, codec, service)
    # The part check, only under a robust rule: under the mean any member bends every part
    # by what it sends, so a run that admits strangers chooses a robust rule, and the check
    # completes it at the reducers.
    deviation_factor = service.config.part_deviation_factor if group.aggregation != MEAN else None
    scan = me.mode.sends and finite_check is FiniteCheck.UPFRONT
    vector, result, backup = await offload(
        executor,
        _prepare,
        tensors,
        layout,
        target,
        scan,
        deviation_factor,
        service.buffers,
        elements=layout.total,
    )
    t_prepared = time.monotonic()

    check_as_encoded = finite_check is FiniteCheck.AS_ENCODED
    # Even then the codec need not check our chunks when it passes the values themselves
    # and refuses NaN/Inf as it decodes or encodes them (`none`), under the mean: a chunk
    # sent to another reducer is checked as that reducer decodes it, a chunk of our own
    # part as our reducer encodes its average (a NaN/Inf spoils the average, and the chunk
    # comes back empty). Either way the chunk keeps our values, where
    # check_local_finite() finds it. The robust rules get checked copies: their
    # kernels sort and compare the values.
    checked_anyway = codec.exact and codec.decodes_finite and not group.rule.robust
    side = MemberSide(group, my_index, plan, codec, vector, executor)
    contribution = Contribution(
        side, weight, signer, codec_checks=check_as_encoded and not checked_anyway
    )
    assembly = ResultAssembly(side, result, deviation_factor, backup, service.buffers)
    streams = PartStreams(contribution, assembly, deadline, service, channels, fault_plan)

    round_: ReducerRound | None = None
    if plan.part_size(my_index) > 0:
        round_ = ReducerRound(
            group,
            my_index,
            plan,
            layout.dtype,
            codec,
            service.config,
            executor,
            deadline,
            assembly.on_local_result,
            fault_plan,
            buffers=service.buffers,
            combiner=service.combiner,
            signer=signer,
        )
        service.register(round_)
        round_.start()
    try:
        errors, t_exchanged = await _exchange(
            group, my_index, weight, deadline, round_, contribution, streams
        )
    finally:
        if round_ is not None:
            await _close_reducer(round_, streams, contribution, service)
    if round_ is not None:
        errors.extend(round_.errors)
    if streams.crashed.is_set():
        raise InjectedCrash(f"member {my_index} crashed as its fault plan says")
    if contribution.non_finite_error is not None:
        raise contribution.non_finite_error

    await offload(executor, _settle, assembly)
    failed = assembly.failed_parts()
    averaged_by_all = assembly.averaged_by_all()
    local_fraction = assembly.local_fraction()
    out = await offload(
        executor, _finish, assembly, layout, out, target, check_as_encoded, elements=layout.total
    )
    t_done = time.monotonic()
    if round_ is not None:
        assembly.adjusted[my_index] = round_.adjusted
        assembly.weights_clipped[my_index] = round_.reducer.weights_clipped
    return AveragingResult(
        tensors=out,
        group_size=group.size,
        peers=[m.peer_id.hex() for m in group.members],
        group_id=group.group_id.hex(),
        codec=group.codec,
        partial=bool(failed) or not averaged_by_all or bool(errors),
        timings={
            "allreduce.prepare": t_prepared - t0,
            "allreduce.exchange": t_exchanged - t_prepared,
            "allreduce.finish": t_done - t_exchanged,
            "allreduce.total": t_done - t0,
        },
        bytes_sent=streams.bytes_sent + (round_.bytes_sent if round_ is not None else 0),
        bytes_received=assembly.bytes_received
        + (round_.bytes_received if round_ is not None else 0),
        gathered={m.peer_id.hex(): m.user_data for m in group.members},
        failed_parts=failed,
        dropped=dict(round_.dropped) if round_ is not None else {},
        errors=tuple(errors),
        aggregation=group.aggregation,
        num_adjusted=sum(assembly.adjusted.values()),
        weights_clipped=sum(assembly.weights_clipped.values()),
        distrusted=dict(assembly.distrusted),
        unconfirmed_ends=dict(assembly.unconfirmed_ends),
        local_fraction=local_fraction,
        part_sizes=tuple(plan.part_size(part) for part in range(group.size)),
    )


def _check_arguments(
    group: GroupInfo,
    my_index: int,
    tensors: Sequence[np.ndarray],
    weight: float,
    deadline: float,
    signer: RequestSigner,
    now: float,
) -> None:
    """Raise what :func:`run_allreduce` documents for arguments it cannot run with."""
    if not 0 <= my_index < group.size:
        raise ValueError(f"my_index {my_index} is not in a group of {group.size}")
    if signer.peer_id != group.members[my_index].peer_id:
        raise ValueError("the signer's peer id is not the peer id of member my_index")
    if not (math.isfinite(weight) and weight >= 0):
        raise ValueError(f"weight must be finite and >= 0, got {weight}")
    if schema_hash(tensors) != group.schema_hash:
        raise ValueError("tensors do not match the group's schema (shapes/dtypes differ)")
    if deadline <= now:
        raise AllReduceError("the round's deadline has already passed")


async def _plan_parts(
    group: GroupInfo, layout: TensorLayout, codec: Codec, service: AllReduceService
) -> PartPlan:
    """The group's parts and chunks, the same on every member: it reads only what the
    group description and the codec give every member alike."""
    probe_key = (codec.name, layout.dtype.name)
    if probe_key not in service.bytes_per_element:
        service.bytes_per_element[probe_key] = await offload(
            service.executor, bytes_per_element, codec, layout.dtype
        )
    # A chunk is at most chunk_bytes on the wire AND in the reduction dtype, so that
    # strongly compressing codecs keep enough chunks per part to pipeline. Unless set, the
    # target follows the group's links (every member reads the same bandwidths).
    chunk_bytes = service.config.chunk_bytes or link_chunk_bytes(group.members)
    chunk_elements = min(
        chunk_elements_for(service.bytes_per_element[probe_key], chunk_bytes),
        chunk_elements_for(float(layout.dtype.itemsize), chunk_bytes),
    )
    return PartPlan.build(part_sizes(group.members, layout.total), chunk_elements)


def _prepare(
    tensors: Sequence[np.ndarray],
    layout: TensorLayout,
    target: np.ndarray | None,
    scan: bool,
    deviation_factor: float | None,
    buffers: BufferPool,
) -> tuple[np.ndarray, np.ndarray, np.ndarray | None]:
    """Our values as one flat vector (a view where the tensors allow), the result's
    memory, and the part check's backup where it needs one (run in the executor).

    Raises:
        ValueError: ``scan`` and the tensors hold NaN/Inf.
    """
    view = flat_view(tensors, layout)
    vector = view if view is not None else flatten(tensors, layout)
    # Flattening only widens (partition.reduction_dtype), so checked inputs stay finite.
    if scan and not all_finite(vector):
        raise ValueError("tensors hold NaN or Inf")
    result = target if target is not None else np.empty_like(vector)
    backup = None
    if ResultAssembly.wants_backup(vector, result, deviation_factor):
        backup = aligned_like(buffers, vector)
    return vector, result, backup


async def _exchange(
    group: GroupInfo,
    my_index: int,
    weight: float,
    deadline: float,
    round_: ReducerRound | None,
    contribution: Contribution,
    streams: PartStreams,
) -> tuple[list[str], float]:
    """Run every exchange of a sending member and our own reducer until all are done, a
    crash, our own tensors refused, or the deadline: whichever is first. Every task is
    cancelled and awaited before this returns.

    Returns:
        Why any task of the round failed, and the ``time.monotonic()`` instant the
        exchanges ended (before their tasks were cancelled).
    """
    loop = asyncio.get_running_loop()
    plan = contribution.side.plan
    tasks: set[asyncio.Task[None]] = set()
    if group.members[my_index].mode.sends:
        if round_ is not None:
            round_.set_local_weight(weight)
            tasks.add(loop.create_task(contribution.contribute_local(round_)))
        for part in range(group.size):
            if part != my_index and plan.part_size(part) > 0:
                tasks.add(loop.create_task(streams.exchange_part(part)))

    async def everything() -> None:
        await asyncio.gather(*tasks)
        if round_ is not None:
            await round_.finished.wait()

    main = loop.create_task(everything())
    crash = loop.create_task(streams.crashed.wait())
    non_finite = loop.create_task(contribution.non_finite.wait())
    errors: list[str] = []
    try:
        done, _ = await asyncio.wait(
            {main, crash, non_finite},
            timeout=deadline - time.monotonic(),
            return_when=asyncio.FIRST_COMPLETED,
        )
        if main in done:
            main.result()  # re-raise a programming error; exchanges themselves never raise
    finally:
        ended = time.monotonic()
        for task in (*tasks, main, crash, non_finite):
            task.cancel()
        ended_tasks = await asyncio.gather(*tasks, main, crash, non_finite, return_exceptions=True)
        for ended_task in ended_tasks[: len(tasks)]:  # main re-raised above; the events never fail
            if isinstance(ended_task, Exception):
                # A task of the round died: say why, and count it in the result, rather
                # than let the gather swallow it.
                reason = f"a task of the round failed: {ended_task!r}"
                log.error("round %s: %s", group.group_id.hex(), reason, exc_info=ended_task)
                errors.append(reason)
    return errors, ended


async def _close_reducer(
    round_: ReducerRound,
    streams: PartStreams,
    contribution: Contribution,
    service: AllReduceService,
) -> None:
    """Close our own reducer, ending the streams it still serves with why the round
    stopped for this member, and take it off the service."""
    abort = None
    if streams.crashed.is_set():
        abort = Abort(grpc.StatusCode.UNAVAILABLE, "peer crashed (injected)")
    elif contribution.non_finite_error is not None:
        abort = Abort(grpc.StatusCode.UNAVAILABLE, "the member's own tensors held NaN or Inf")
    elif not round_.finished.is_set():
        abort = Abort(grpc.StatusCode.DEADLINE_EXCEEDED, "round deadline passed")
    await round_.close(abort)
    service.unregister(round_)


def _settle(assembly: ResultAssembly) -> None:
    """Take no more replies, then run the part check (run in the executor)."""
    assembly.seal()  # waits for a decode still running in a thread: never on the loop
    assembly.check_parts()  # a few medians of the sums counted as replies came: no data pass


def _finish(
    assembly: ResultAssembly,
    layout: TensorLayout,
    out: Sequence[np.ndarray] | None,
    target: np.ndarray | None,
    check_as_encoded: bool,
) -> list[np.ndarray]:
    """The result tensors: local values where no trusted average came, in ``out`` or in
    new arrays (run in the executor).

    Raises:
        InvalidTensorsError: ``check_as_encoded``, and a chunk that kept our own values
            holds NaN/Inf.
    """
    assembly.fill_missing()
    if check_as_encoded:
        assembly.check_local_finite()
    if out is None:
        return unflatten(assembly.result, layout, copy=False)  # result is ours to hand over
    if target is None:  # `out` is not one span: one copy into the caller's arrays
        for dst, src in zip(out, unflatten(assembly.result, layout, copy=False), strict=True):
            np.copyto(dst, src)
    return list(out)
