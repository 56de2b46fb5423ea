"""The averager: the daemon-side facade of ``swarmavg.averaging`` (docs/averaging.md).

One :class:`Averager` per daemon composes matchmaking (who averages with whom), the
butterfly all-reduce (moving and reducing the bytes) and state sharing, over one DHT node
and one pool of channels. Usage::

    averager = Averager(dht_node, AveragerConfig(), channels)
    averager.add_to_server(server)          # before server.start()
    await averager.start()
    result = await averager.average([grad], key="step-42", timeout=30.0)
    await averager.publish_state(params, metadata=b"step=42")
    metadata, params = await averager.load_state(timeout=60.0)
    await averager.shutdown(grace=5.0)
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import math
import time
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc
import numpy as np

from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.data_connector import DataConnector
from swarmavg.averaging.allreduce.faults import FaultPlan
from swarmavg.averaging.allreduce.load_balancing import equal_share_factor
from swarmavg.averaging.allreduce.runner import FiniteCheck, run_allreduce
from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.averaging.allreduce.throughput import ThroughputEstimator
from swarmavg.averaging.errors import (
    AveragingError,
    InvalidRequestError,
    NoGroupError,
    SchemaMismatchError,
)
from swarmavg.averaging.group import MAX_GROUP_SIZE, Mode, describe_layout, schema_hash
from swarmavg.averaging.matchmaking.closing import key_family
from swarmavg.averaging.matchmaking.keys import GroupKeyManager, validate_bits
from swarmavg.averaging.matchmaking.matchmaker import (
    DHTAccess,
    Matchmaker,
    MatchmakerConfig,
    MatchRequest,
    Observer,
)
from swarmavg.averaging.request import RoundRequest, check_finite, check_tensors
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.service import AveragingServicer, Components, add_to_server
from swarmavg.averaging.state.config import DonorFaults, StateSharingConfig
from swarmavg.averaging.state.sharer import StateSharer
from swarmavg.averaging.transfer_progress import TransferProgress
from swarmavg.compression import get_codec
from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.ranges import split_host

log = logging.getLogger(__name__)


class _RunConfig(Protocol):
    @property
    def run_id(self) -> str: ...


class AveragerDHT(DHTAccess, Protocol):
    """What the averager needs of :class:`swarmavg.dht.DHTNode`."""

    @property
    def config(self) -> _RunConfig: ...

    @property
    def address(self) -> str | None: ...


@dataclass(frozen=True)
class AveragerConfig:
    """Settings of one daemon's averager.

    Attributes:
        mode: ``NODE`` (send and reduce), ``CLIENT`` (send only; set it for peers that
            cannot accept connections) or ``AUX`` (reduce only, weight 0).
        bandwidth: this peer's bandwidth in MB/s; parts are sized in proportion to it.
            ``None``: measured from this peer's rounds
            (:class:`~swarmavg.averaging.allreduce.throughput.ThroughputEstimator`).
        target_group_size: group size when ``average`` is called with ``group_size=None``.
        matchmaking_time: seconds a leader waits for more peers before it closes a group
            that is not full (it closes at once when full).
        matchmaking_share: at most this share of a round's timeout goes to matchmaking:
            the leader's wait is ``min(matchmaking_time, share * timeout)``, and a peer that
            found no group by ``share * timeout`` raises :class:`NoGroupError`.
        default_codec: codec of groups this peer leads when ``average`` names none.
        group_bits: initial Moshpit group bits (see :mod:`swarmavg.averaging.matchmaking.keys`);
            empty: every peer of the run meets under one key.
        user_data: opaque bytes given to every member of our groups (a round that attaches
            a state digest hands the tagged digest instead, ``RoundRequest.user_data``).
        timeout_grace: extra seconds a round may take past its timeout to cancel its
            streams before it raises.
    """

    mode: Mode = Mode.NODE
    bandwidth: float | None = None
    target_group_size: int = 16
    matchmaking_time: float = 5.0
    matchmaking_share: float = 0.5
    default_codec: str = "none"
    group_bits: str = ""
    user_data: bytes = b""
    timeout_grace: float = 0.5
    matchmaker: MatchmakerConfig = field(default_factory=MatchmakerConfig)
    allreduce: AllReduceConfig = field(default_factory=AllReduceConfig)
    state: StateSharingConfig = field(default_factory=StateSharingConfig)

    def __post_init__(self) -> None:
        if self.bandwidth is not None and not (
            math.isfinite(self.bandwidth) and self.bandwidth >= 0
        ):
            raise ValueError(f"bandwidth must be finite and >= 0, got {self.bandwidth}")
        if not 1 <= self.target_group_size <= MAX_GROUP_SIZE:
            raise ValueError(f"target_group_size must be in 1..{MAX_GROUP_SIZE}")
        if not self.matchmaking_time > 0:
            raise ValueError("matchmaking_time must be positive")
        if not 0 < self.matchmaking_share < 1:
            raise ValueError("matchmaking_share must be in (0, 1)")
        if self.timeout_grace < 0:
            raise ValueError("timeout_grace must be >= 0")
        validate_bits(self.group_bits)
        get_codec(self.default_codec)  # ValueError listing the known codecs


class Averager:
    """Averages tensors with other peers of the run; serves and loads published state.

    Lifecycle: construct (no I/O), :meth:`add_to_server` before the server starts,
    :meth:`start` once inside the running loop, :meth:`shutdown` (idempotent).
    """

    def __init__(
        self,
        dht: AveragerDHT,
        config: AveragerConfig | None = None,
        channels: ChannelPool | None = None,
        *,
        observer: Observer | None = None,
        fault_plan: FaultPlan | None = None,
        donor_faults: DonorFaults | None = None,
    ) -> None:
        """Args:
        dht: this daemon's started (or soon started) DHT node.
        config: settings; defaults when ``None``.
        channels: the daemon's channel pool, shared with the DHT; when ``None`` the
            averager makes its own in :meth:`start` and closes it in :meth:`shutdown`.
        observer: matchmaking progress callback (logs, metrics, tests).
        fault_plan: all-reduce fault seam for tests and benchmarks.
        donor_faults: state-sharing fault seam for tests.
        """
        self.dht = dht
        self.config = config or AveragerConfig()
        self.run_id = dht.config.run_id
        self._channels = channels
        self._own_channels = channels is None
        self._observer = observer
        self._fault_plan = fault_plan
        self._donor_faults = donor_faults
        self._keys = GroupKeyManager(self.run_id, self.config.group_bits)
        self.bandwidth = ThroughputEstimator(self.config.bandwidth)
        """What this peer advertises in matchmaking (MB/s): set, or measured from rounds."""
        self._components: Components | None = None
        self._servicer = AveragingServicer(lambda: self._components)
        self._rounds: set[asyncio.Task[Any]] = set()
        self._closed = False
        self.announced_data_port = 0
        """The data-plane port others are told (0: the bound one); a relayed port behind NAT."""

    @property
    def group_bits(self) -> str:
        """Current Moshpit group bits (advance after every formed group)."""
        return self._keys.group_bits

    @property
    def matchmaker(self) -> Matchmaker:
        """The matchmaking component (counters: ``closes`` by reason, measured latencies).

        Raises:
            RuntimeError: the averager is not running.
        """
        return self._require()[0]

    @property
    def state_sharer(self) -> StateSharer:
        """The state-sharing component (counters: ``served_chunks``, ``downloaded_chunks``).

        Raises:
            RuntimeError: the averager is not running.
        """
        return self._require()[2]

    @property
    def data_port(self) -> int:
        """Port of this peer's all-reduce data plane (0: none; raises like ``matchmaker``)."""
        return self._require()[1].data_port

    @property
    def data_connector(self) -> DataConnector | None:
        """The all-reduce's data-plane connector (None: no data plane; raises like
        ``matchmaker``)."""
        return self._require()[1].data_connector

    def relocate(self, address: str, data_port: int) -> None:
        """Announce ``address`` and ``data_port`` from the next round on (a NATed peer whose
        reservation moved to another relay); rounds in flight keep the old ones."""
        matchmaker, _, sharer = self._require()
        matchmaker.address = address
        sharer.address = address
        self.announced_data_port = data_port

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the ``Averaging`` service on ``server`` (before it starts)."""
        add_to_server(self._servicer, server)

    async def start(self) -> None:
        """Create the components inside the running loop. Call once, after the DHT started.

        Raises:
            RuntimeError: already started or shut down.
        """
        if self._components is not None or self._closed:
            raise RuntimeError("Averager.start() may be called once")
        if self._channels is None:
            self._channels = ChannelPool()
        address = None if self.config.mode is Mode.CLIENT else self.dht.address
        matchmaker = Matchmaker(
            self.dht, self.run_id, address, self._channels, self.config.matchmaker, self._observer
        )
        # A private run's pool holds the peer's TLS setup: the data plane uses it too, so that
        # no byte of a round travels in clear.
        allreduce = AllReduceService(
            self.dht.authenticator, self.config.allreduce, tls=self._channels.tls
        )
        if address is not None and self.config.mode.reduces:
            await allreduce.start_data_plane(self.config.allreduce.data_host or split_host(address))
        sharer = StateSharer(
            self.dht, self.run_id, address, self._channels, self.config.state, self._donor_faults
        )
        self._components = (matchmaker, allreduce, sharer)
        matchmaker.announce(self.config.mode)

    def _require(self) -> Components:
        if self._components is None:
            raise RuntimeError("Averager is not running (call start() first)")
        return self._components

    async def average(
        self,
        tensors: Sequence[np.ndarray],
        key: str,
        weight: float = 1.0,
        group_size: int | None = None,
        min_group_size: int = 2,
        timeout: float = 30.0,
        codec: str | None = None,
        state_digest: bytes | None = None,
        aggregation: str | None = None,
        max_group_size: int | None = None,
    ) -> AveragingResult:
        """Average ``tensors`` with the peers that average under ``key`` now.

        The in-process entry point: it checks its arguments as the daemon's control
        service does (:class:`~swarmavg.averaging.request.RoundRequest`) and calls
        :meth:`run`. Every member gets ``sum(w_i * x_i) / sum(w_i)`` (within the codec's
        error), bit-identical across members. The caller's arrays are never modified.

        Args:
            tensors: numpy arrays (float16/bfloat16/float32/float64, int8/uint8/int32/int64).
            key: what is averaged (e.g. ``"step-42"``); peers meet under the same key.
            weight: this peer's weight, finite and >= 0 (0 in ``AUX`` mode, whatever is given).
            group_size: most members per group; ``None``: ``config.target_group_size``.
            min_group_size: fewest members with which a group may close.
            timeout: seconds for the whole call (matchmaking and all-reduce).
            codec: codec of the group when this peer leads; ``None``: the default.
            state_digest: a digest (at most 64 bytes) of this peer's shared state, handed
                to every member; the result's ``state_digests`` holds every member's.
            aggregation: ``"mean"`` (``None``), ``"centered-clip"`` or ``"trimmed-mean"``,
                parameters in the name (docs/averaging.md, "Aggregation"); only peers
                asking for the same rule average together.
            max_group_size: the most members per group, above ``group_size``, which is
                then the number of peers waited for (``RoundRequest.max_group_size``);
                ``None``: ``group_size``.

        Raises:
            InvalidTensorsError: empty list, unsupported dtype, NaN/Inf (nothing is sent).
            InvalidRequestError: an invalid parameter (a ``ValueError``).
            NoGroupError: fewer than ``min_group_size`` peers by the matchmaking deadline.
            SchemaMismatchError: no group, and the peers found average another schema.
            AveragingError: the round failed or overran ``timeout`` (plus a small grace).
        """
        request = RoundRequest.build(
            key=key,
            weight=weight,
            timeout=timeout,
            group_size=group_size,
            min_group_size=min_group_size,
            codec=codec,
            state_digest=state_digest,
            aggregation=aggregation,
            max_group_size=max_group_size,
            allow_zero_weight=True,
        )
        arrays = check_tensors(tensors)
        await asyncio.to_thread(check_finite, arrays)
        return await self.run(arrays, request)

    async def run(
        self,
        arrays: Sequence[np.ndarray],
        request: RoundRequest,
        *,
        out: Sequence[np.ndarray] | None = None,
        inputs_ready: Awaitable[object] | None = None,
        checked_by_client: bool = False,
    ) -> AveragingResult:
        """Run one round for a checked request: matchmaking, then the all-reduce.

        Args:
            arrays: tensors that passed :func:`~swarmavg.averaging.request.check_tensors`
                and :func:`~swarmavg.averaging.request.check_finite` (not checked again),
                unless ``checked_by_client``.
            request: the round's parameters; its ``deadline`` bounds the whole call.
            out: arrays of ``arrays``' layout, not overlapping them, that receive the
                result (``run_allreduce``'s ``out``); ``None``: new arrays.
            inputs_ready: when given, ``arrays`` are still being filled and checked (the
                daemon's copy of a client's tensors); matchmaking declares meanwhile and
                waits for it before joining a group, and its exception ends the call.
            checked_by_client: ``arrays`` were checked for NaN/Inf by the process that
                wrote them, which says so (a client's shared memory), not here: the round
                checks each chunk as its codec encodes it (``FiniteCheck.AS_ENCODED``), and
                a NaN/Inf raises ``InvalidTensorsError`` after the group formed.

        Raises:
            InvalidRequestError: ``min_group_size`` exceeds the default group size.
            NoGroupError, SchemaMismatchError, AveragingError: as :meth:`average`.
        """
        matchmaker, allreduce, _ = self._require()
        started = time.monotonic()
        size = self.config.target_group_size if request.group_size is None else request.group_size
        cap = request.max_group_size or size
        if request.min_group_size > size:
            raise InvalidRequestError(
                f"min_group_size {request.min_group_size} is larger than the group size {size}"
            )
        codec = request.codec or self.config.default_codec
        mode = self.config.mode
        weight = 0.0 if mode is Mode.AUX else request.weight
        give_up_by = started + self.config.matchmaking_share * (request.deadline - started)
        # A leader closes a little before it would give up, so the group reaches followers
        # that started with it before they give up too (they started later, or together).
        margin = min(self.config.matchmaker.join_timeout, 0.1 * max(give_up_by - started, 0.0))
        match = MatchRequest(
            key=self._keys.key_for(request.key),
            schema_hash=schema_hash(arrays),
            group_size=cap,
            min_group_size=request.min_group_size,
            codec=codec,
            mode=mode,
            bandwidth=self.bandwidth.value,
            user_data=request.user_data(self.config.user_data),
            close_by=min(started + self.config.matchmaking_time, give_up_by - margin),
            latest_close_by=max(started, give_up_by - margin),
            give_up_by=give_up_by,
            data_port=self.announced_data_port or allreduce.data_port,
            wanted=request.group_size or 0,
            family=self._keys.key_for(key_family(request.key)),
            aggregation=request.aggregation,
        )
        task = asyncio.current_task()
        if task is not None:
            self._rounds.add(task)
        phase = "matchmaking"
        phases: dict[str, float] = {}
        try:
            async with asyncio.timeout(request.remaining() + self.config.timeout_grace):
                group = await matchmaker.find_group(match, inputs_ready, phases)
                matched = time.monotonic()
                index = group.index_of(self.dht.peer_id)
                if index is None:  # find_group checks this; keep mypy and -O honest
                    raise AveragingError("matchmaking returned a group without this peer")
                together = self._keys.on_group_formed(group.group_id, index, group.size)
                matchmaker.carry_previous(
                    match.family,
                    self._keys.key_for(key_family(request.key)),
                    {group.members[j].peer_id for j in together},
                )
                phase = "allreduce"
                result = await run_allreduce(
                    group,
                    index,
                    arrays,
                    weight,
                    deadline=request.deadline,
                    service=allreduce,
                    channels=self._channels_or_fail(),
                    signer=self.dht.signer,
                    fault_plan=self._fault_plan,
                    finite_check=(
                        FiniteCheck.AS_ENCODED if checked_by_client else FiniteCheck.DONE
                    ),
                    out=out,
                )
        except SchemaMismatchError as error:
            # The other side's error names its own layout: the two messages side by side
            # show what differs (a declaration carries only the layout's hash).
            raise SchemaMismatchError(f"{error}; ours: {describe_layout(arrays)}") from None
        except TimeoutError:
            if phase == "matchmaking":
                raise NoGroupError(
                    f"no group formed under {request.key!r} by the call's deadline"
                ) from None
            raise AveragingError(f"round under {request.key!r} overran its deadline") from None
        finally:
            if task is not None:
                self._rounds.discard(task)
        done = time.monotonic()
        # The bytes this member would have moved with an equal part: its own part's size
        # says nothing of its link (load_balancing.equal_share_factor).
        busier = max(result.bytes_sent, result.bytes_received)
        busier_equal = round(busier * equal_share_factor(group.members, index, result.part_sizes))
        self.bandwidth.observe(
            busier_equal,
            result.timings["allreduce.exchange"],
            partial=result.partial,
            group=[m.bandwidth for m in group.members if m.is_reducer],
        )
        log.debug(
            "round under %r: measured %.2f MB/s, advertising %.2f MB/s",
            request.key,
            busier_equal / 1e6 / max(result.timings["allreduce.exchange"], 1e-9),
            self.bandwidth.value,
        )
        timings = {
            "matchmaking": matched - started,
            "allreduce": done - matched,
            "total": done - started,
            **{f"matchmaking.{name}": seconds for name, seconds in phases.items()},
            **result.timings,
        }
        return dataclasses.replace(result, timings=timings)

    def _channels_or_fail(self) -> ChannelPool:
        if self._channels is None:
            raise RuntimeError("Averager is not running")
        return self._channels

    async def publish_state(
        self, tensors: Sequence[np.ndarray], metadata: bytes, version: float | None = None
    ) -> None:
        """Serve ``(metadata, tensors)`` to late joiners and advertise it in the DHT.

        ``version`` orders publications (default: the current unix time; the freshest
        wins). Publishing again replaces what this peer advertises; the previous version
        stays servable for a bounded grace (``StateSharingConfig.retain_versions`` and
        ``retain_seconds``) so that downloads of it in progress can finish.

        Raises:
            ValueError: unsupported dtype or a state over the size limits.
        """
        _, _, sharer = self._require()
        await sharer.publish(tensors, metadata, version)

    async def load_state(
        self, timeout: float = 60.0, max_bytes: int | None = None
    ) -> tuple[bytes, list[np.ndarray]]:
        """Download the freshest published state of the run: ``(metadata, tensors)``.

        ``max_bytes`` bounds the state accepted (see :meth:`StateSharer.load`).

        Raises:
            StateNotFoundError: nobody publishes state.
            StateDownloadError: no donor delivered a complete, verified copy.
            AveragingError: ``timeout`` passed.
        """
        _, _, sharer = self._require()
        try:
            return await sharer.load(timeout, max_bytes)
        except TimeoutError:
            raise AveragingError(f"loading state took longer than {timeout}s") from None

    @property
    def state_progress(self) -> TransferProgress | None:
        """The newest state download's progress (None before the first or when stopped)."""
        return None if self._components is None else self._components[2].progress

    async def shutdown(self, grace: float = 5.0) -> None:
        """Stop: disband pending groups, let rounds in flight finish within ``grace``
        seconds (then cancel them), stop serving. Idempotent."""
        if self._closed:
            return
        self._closed = True
        components = self._components
        if components is not None:
            matchmaker, allreduce, sharer = components
            await matchmaker.shutdown()
            if self._rounds:
                _, pending = await asyncio.wait(set(self._rounds), timeout=grace)
                for task in pending:
                    task.cancel()
                if pending:  # let the cancelled rounds close their streams
                    await asyncio.wait(pending, timeout=1.0)
            await sharer.shutdown()
            await allreduce.close()
        self._components = None
        if self._own_channels and self._channels is not None:
            with contextlib.suppress(Exception):
                await self._channels.close()
