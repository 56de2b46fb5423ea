"""Settings of the butterfly all-reduce (one object per daemon, shared by every round)."""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, field

from swarmavg.averaging.allreduce.congestion import AUTO, check_name
from swarmavg.averaging.allreduce.part_check import DEFAULT_FACTOR as PART_DEVIATION_FACTOR
from swarmavg.averaging.allreduce.partition import MAX_CHUNK_BYTES, MIN_CHUNK_BYTES
from swarmavg.averaging.allreduce.reducer import DEFAULT_WEIGHT_BOUND
from swarmavg.averaging.allreduce.slow_senders import DEFAULT_FACTOR as SLOW_SENDER_FACTOR

MAX_STREAMS_PER_SENDER = 8
"""The most streams a reducer takes from one sender in one round (a protocol limit, said to
senders in every tagged reply: ``ReduceResponse.stripes``)."""


def _default_executor_threads() -> int:
    return 0 if (os.cpu_count() or 1) <= 2 else 2


@dataclass(frozen=True)
class AllReduceConfig:
    """Timing and sizing of all-reduce rounds.

    Attributes:
        chunk_bytes: target size of one encoded chunk on the wire (gRPC's 4 MiB message
            cap stays). ``None`` (the default): chosen per round from the group's
            advertised bandwidths (:func:`~swarmavg.averaging.allreduce.chunking.link_chunk_bytes`:
            512 KiB-1 MiB on 100 Mbit/s links, 2 MiB on loopback and fast LANs). A fixed value
            must be the same on every member of a group (members cut the same chunks).
        min_stall: a sender that delivers nothing new for this long (and for
            ``stall_factor`` times its own mean interval between chunks; twice this long
            before its first chunk) is dropped by the reducer; a reducer that returns
            nothing for three times this long (and ``stall_factor`` times its mean
            interval) is given up by the sender.
        stall_factor: how many mean inter-chunk intervals of silence count as a stall.
        registration_wait: how long an inbound stream waits for the local side of its
            round to start (members leave matchmaking at slightly different times).
        finalize_margin: the reducer stops waiting for senders this long before the
            round's deadline (at most a tenth of the round's budget), so that the
            averaged chunks still reach the senders in time.
        max_waiting_streams: inbound streams allowed to wait for an unknown group at
            once; more are refused with RESOURCE_EXHAUSTED.
        max_waiting_per_range: of those, streams from one address range (an IPv4 /24, an
            IPv6 /48, of the connection: dht/ranges.py) at once; far below
            ``max_waiting_streams``, so that one network, whatever identities it signs
            with, leaves slots to every other.
        max_waiting_per_peer: of those, streams signed by one verified peer id at once.
            An honest member has ``streams_per_reducer`` streams (1 by default) per part
            per round to a reducer.
        max_pending_per_range: inbound streams from one address range not yet serving a
            round (waiting for their first message, being checked, waiting for their
            group) at once; more are refused with RESOURCE_EXHAUSTED before anything is
            read, so that silent streams of one network hold few handlers.
        first_message_timeout: an inbound stream whose first message has not arrived
            within this long is cut (an honest sender writes it as soon as it opens the
            stream). At most ``registration_wait`` counts.
        limit_local_ranges: apply the per-range limits above to loopback and private
            sources too (off: a LAN cluster or a test swarm shares one range; tests turn it
            on to stand for distinct networks on 127.x.y.z), as
            ``DHTConfig.limit_local_ranges``.
        keyed_streams_only: refuse a ``Reduce`` stream whose signed first message carries no
            stream key (an older sender's): every stream served is then MACed end to end
            (docs/security.md). Off, such a stream is served as before keys existed, its
            later messages covered by nothing but the transport. A key cannot be stripped
            on the way (the signature covers it), so this only decides about older peers.
        write_timeout: a reply (gRPC message or data-plane frame) that the transport has
            not taken within this long means its sender stopped reading: the stream is cut
            (``DEADLINE_EXCEEDED``) and the sender dropped, so it pins nothing longer.
        max_reply_backlog: bytes of averaged chunks queued for one sender that it has not
            read yet; a sender further behind is cut (``RESOURCE_EXHAUSTED``) and what was
            queued for it freed. An honest sender reads its replies as they come (the
            reducer emits at the pace of the slowest sender), so it stays far below.
        max_codec_instances: codec instances kept across rounds (stateful ones, ``topk``,
            hold up to 1 GiB of error-feedback residuals each); the least recently used
            is dropped beyond it. An honest run uses one or two codecs.
        executor_threads: threads for codec work and reduction, off the event loop; 0
            runs it on the loop. Default: 0 on machines with at most 2 cores, where the
            thread pool cost 10-30% more CPU per round than inline work
            (docs/benchmarks-data-path.md), else 2.
        data_plane: also serve and use ``Reduce`` over framed TCP
            (:mod:`~swarmavg.averaging.allreduce.data_server`), which costs less than half the CPU
            per byte of gRPC; members that cannot reach it fall back to gRPC.
        data_host: host the data plane listens on; ``None``: the host of the peer's
            announced address.
        data_port: port the data plane listens on (0: any free port). Set it when only
            chosen ports are reachable (a firewall or NAT forwards them).
        data_connect_timeout: how long a sender tries to connect to a reducer's data
            plane before it uses gRPC for that reducer (for ``data_retry_after`` seconds).
        data_retry_after: see ``data_connect_timeout``.
        weight_bound: a sender's weight counts as at most this many times the median
            weight of the part's senders (one member must not dictate the
            mean); larger weights are clipped to it and counted. >= 1.
        congestion_control: TCP congestion control algorithm of the data plane's sockets,
            both the connections this peer opens and the ones it accepts (``cubic``,
            ``bbr``, ...; :mod:`~swarmavg.averaging.allreduce.congestion`). ``"auto"``
            (the default): BBR on paths of 75 ms of round trip or more where the process
            may use it, the kernel's default elsewhere. ``"kernel"`` or ``None``: the
            kernel's default everywhere. The service checks a name at start.
        part_deviation_factor: a member refuses a part whose averages are farther from its
            own values than this many times the median of the other parts, both in rms and
            in units of its own values' rms (:mod:`~swarmavg.averaging.allreduce.part_check`):
            the part keeps local values, as from a distrusted reducer. ``None`` turns the
            check off. It runs in rounds of a robust rule only (``centered-clip``,
            ``trimmed-mean``): under the mean every member bends every part by what it
            sends anyway. > 1.
        streams_per_reducer: how many data-plane connections a member sends a part over
            to its reducer at once, each carrying every ``streams_per_reducer``-th chunk
            and bringing back their averages (1 to :data:`MAX_STREAMS_PER_SENDER`). Used
            towards a reducer once it said, on an earlier stream keyed with the secret this
            one resumes, that it takes them (an older reducer never says so: one stream);
            over gRPC, whose streams share one connection, one stream. 1 by default: on the
            100 Mbit/s test bed four made 16 MB rounds 5 % faster at 50 ms RTT, changed
            nothing at 200 ms or at 64 MB, and at no delay (BBR, a 50 ms queue) raised
            retransmissions to 10-12 % and starved a connection long enough that its
            sender was dropped (docs/benchmarks.md, "Parallel connections per peer
            pair"). Each stream is one more TCP flow into every receiver's link.
        slow_sender_factor: a sender still delivering its chunks of a part this many times
            as long after its first chunk as the part's median remote sender took (and at
            least ``min_stall``) is dropped, as a stalled one is
            (:mod:`~swarmavg.averaging.allreduce.slow_senders`): the stall detector's
            patience follows the sender's own pace, which a sender that trickles chooses.
            An honest link at a quarter of the others' bandwidth takes about 4x. > 1.
    """

    chunk_bytes: int | None = None
    min_stall: float = 3.0
    stall_factor: float = 8.0
    registration_wait: float = 5.0
    finalize_margin: float = 0.5
    max_waiting_streams: int = 64
    max_waiting_per_range: int = 8
    max_waiting_per_peer: int = 4
    max_pending_per_range: int = 32
    first_message_timeout: float = 2.0
    limit_local_ranges: bool = False
    keyed_streams_only: bool = False
    write_timeout: float = 10.0
    max_reply_backlog: int = 32 << 20
    max_codec_instances: int = 4
    executor_threads: int = field(default_factory=_default_executor_threads)
    data_plane: bool = True
    data_host: str | None = None
    data_port: int = 0
    data_connect_timeout: float = 1.0
    data_retry_after: float = 300.0
    weight_bound: float = DEFAULT_WEIGHT_BOUND
    congestion_control: str | None = AUTO
    part_deviation_factor: float | None = PART_DEVIATION_FACTOR
    slow_sender_factor: float = SLOW_SENDER_FACTOR
    streams_per_reducer: int = 1

    def __post_init__(self) -> None:
        if self.chunk_bytes is not None and not (
            MIN_CHUNK_BYTES <= self.chunk_bytes <= MAX_CHUNK_BYTES
        ):
            raise ValueError("chunk_bytes must be within 4 KiB..3 MiB (gRPC caps messages at 4)")
        for name in (
            "min_stall",
            "stall_factor",
            "registration_wait",
            "write_timeout",
            "first_message_timeout",
        ):
            if not getattr(self, name) > 0:
                raise ValueError(f"{name} must be positive")
        if not (math.isfinite(self.weight_bound) and self.weight_bound >= 1.0):
            raise ValueError("weight_bound must be a finite number >= 1")
        if not (math.isfinite(self.slow_sender_factor) and self.slow_sender_factor > 1):
            raise ValueError("slow_sender_factor must be a finite number > 1")
        factor = self.part_deviation_factor
        if factor is not None and not (math.isfinite(factor) and factor > 1):
            raise ValueError("part_deviation_factor must be a finite number > 1, or None")
        if self.finalize_margin < 0:
            raise ValueError("finalize_margin must be >= 0")
        if not 0 <= self.data_port <= 65535:
            raise ValueError("data_port must be a TCP port, or 0 for any free one")
        if not (self.data_connect_timeout > 0 and self.data_retry_after >= 0):
            raise ValueError("data_connect_timeout must be > 0 and data_retry_after >= 0")
        if self.max_reply_backlog < MAX_CHUNK_BYTES + (64 << 10):
            raise ValueError("max_reply_backlog must hold at least one chunk (3 MiB + 64 KiB)")
        if not 1 <= self.streams_per_reducer <= MAX_STREAMS_PER_SENDER:
            raise ValueError(
                f"streams_per_reducer must be within 1..{MAX_STREAMS_PER_SENDER}, "
                f"got {self.streams_per_reducer}"
            )
        if self.max_codec_instances < 1:
            raise ValueError("max_codec_instances must be >= 1")
        if self.congestion_control is not None:
            check_name(self.congestion_control)
        if self.max_waiting_streams < 1 or self.executor_threads < 0:
            raise ValueError("max_waiting_streams must be >= 1 and executor_threads >= 0")
        for name in ("max_waiting_per_range", "max_waiting_per_peer", "max_pending_per_range"):
            if getattr(self, name) < 1:
                raise ValueError(f"{name} must be >= 1")
