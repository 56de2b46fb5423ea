"""Frames of the data plane over one connection: reading, writing, flow control, and (on a
server) the admission of every frame body against the byte budget.

Wire (see :mod:`~swarmavg.averaging.allreduce.data_server` for the exchange)::

    <u32 little-endian body length> <u8 kind> <body>

A server charges a body to the budget before it allocates it
(:mod:`~swarmavg.averaging.allreduce.admission`), and what it charges depends on the
connection's :class:`~swarmavg.averaging.allreduce.admission.Standing`: until the current
stream is known to serve a round here (its signed first message verified, its sender a
member of the group), a body counts against the connection's address range in the small
pending pool, and once the first message has arrived nothing more is read until the
stream is admitted. A header and a stalled body are therefore worth little to an outsider:

* a pending stream's body must arrive at the pace of a live sender (:data:`MIN_BODY_RATE`
  after :data:`BODY_GRACE`), else the connection is cut and its bytes freed; a member's
  body (its stream admitted, or a pending one from the host of a member of a recent round
  here once it misses that pace) need only keep arriving (some bytes every
  :data:`MEMBER_BODY_SILENCE`): a member's link may be far slower than any fixed rate, and
  the round bounds a member that trickles (``slow_senders``);
* a pending body that waits for the budget longer than ``pending_wait`` is refused with
  ``RESOURCE_EXHAUSTED`` before anything of its stream was processed, so its sender uses
  gRPC instead (a refused stream is not a duplicate there);
* the server may evict a pending body (:meth:`FrameProtocol.refuse`) to make room for a
  range that holds less.
"""

from __future__ import annotations

import asyncio
import collections
import itertools
import logging
import socket
import struct
from collections.abc import Callable, Sequence
from typing import cast

import grpc
import numpy as np

from swarmavg.averaging.allreduce.admission import Account, ByteBudget, Standing, accounts_for
from swarmavg.averaging.allreduce.congestion import (
    AUTO,
    KERNEL,
    CongestionControlError,
    apply_for_path,
    get_congestion_control,
    restart_congestion_control,
    set_congestion_control,
)
from swarmavg.dht.tls import peer_id_of_der

log = logging.getLogger(__name__)

__all__ = ["MAGIC", "MAX_BODY", "FrameProtocol", "ProtocolError"]

HELLO, MSG, CLOSE, STATUS = 0, 1, 2, 3
KINDS = frozenset((HELLO, MSG, CLOSE, STATUS))
HEAD = struct.Struct("<IB")
MAGIC = b"swarmavg-reduce/2"
MAX_BODY = (4 << 20) + (64 << 10)
"""Largest frame body accepted: gRPC's 4 MiB message cap, which every chunk respects
(``AllReduceConfig.chunk_bytes`` is at most ``partition.MAX_CHUNK_BYTES``, 3 MiB), plus
room for headers."""
MAX_DETAILS = 1024
END_WAIT = 2.0  # seconds a server drains a refused client before it closes the connection
BODY_GRACE = 2.0
MIN_BODY_RATE = 256 << 10
"""Bytes per second a pending stream's body must arrive at, after :data:`BODY_GRACE`: a
4 MiB body gets 18 s. A pending body is a stream's first message: its signed opening, a few
hundred bytes, which a live sender delivers far faster on any link, or for a resumed stream
the opening with its first chunk, which is why a pending body from a recent member's host
is held to the member's rule once it misses this pace. A body that stops costs its bytes
that long, not for as long as the connection may stay idle."""
MEMBER_BODY_SILENCE = 30.0
"""Seconds a member's body may go without a byte before the connection is cut. Not a rate:
a chunk crosses the sender's link beside every other stream of the round (six on a group of
four, thirty in a group of sixteen), so on a 2 Mbit/s link a 256 KiB chunk takes about 6 s
at each stream's share, and the fixed rate cut such honest senders from every round (test
bed, 4 hosts at 2 Mbit/s). Long, because a flow that shares a slow link's short queue with
five others can lose a segment and its retransmissions in a row and back off for several
seconds (a silence of over 5 s was seen there); the round drops a member that stalls long
before (its stall detector), so this only frees the bytes of a connection left mid-body."""
# Flow control: a connection stops being read while this much is buffered, so that a
# peer that sends faster than we reduce (or a hostile one) holds little memory here.
_QUEUE_HIGH_FRAMES = 16
_QUEUE_HIGH_BYTES = 4 << 20
_WRITE_HIGH = 4 << 20
_WRITE_LOW = 1 << 20
CODES = {code.value[0]: code for code in grpc.StatusCode}
_order = itertools.count()  # admission order of pending bodies, across connections


def _is_pending(accounts: tuple[Account, ...]) -> bool:
    return accounts[:1] == (("pending", ""),)


class ProtocolError(ValueError):
    """The other side broke the framing rules."""


class BodyStalled(TimeoutError):
    """A frame body stopped arriving at the pace of a live sender."""


def status_body(code: grpc.StatusCode, details: str) -> bytes:
    return bytes((code.value[0],)) + details.encode("utf-8", "replace")[:MAX_DETAILS]


def parse_status(body: memoryview) -> tuple[grpc.StatusCode, str]:
    if len(body) < 1 or len(body) > 1 + MAX_DETAILS or body[0] not in CODES:
        return grpc.StatusCode.INTERNAL, "malformed status frame"
    return CODES[body[0]], bytes(body[1:]).decode("utf-8", "replace")


class FrameProtocol(asyncio.BufferedProtocol):
    """Frames in (read straight into their final buffers) and out, with flow control."""

    def __init__(
        self,
        admit: Callable[[FrameProtocol, str], bool] | None = None,
        budget: ByteBudget | None = None,
        congestion_control: str | None = None,
        *,
        make_room: Callable[[FrameProtocol, int], None] | None = None,
        pending_wait: float = 2.0,
        member_host: Callable[[str], bool] | None = None,
    ) -> None:
        """Args:
        admit: on a server, called with the client's host once connected (after the TLS
            handshake); ``False`` refuses the connection (see :attr:`reject`). It sets
            :attr:`range_key`.
        budget: on a server, the bytes every frame body is charged to before it is
            allocated (:mod:`~swarmavg.averaging.allreduce.admission`).
        congestion_control: TCP congestion control algorithm for the connection's socket
            (:mod:`~swarmavg.averaging.allreduce.congestion`); ``None``: the kernel's default.
        make_room: on a server, called when a pending body does not fit the pending pool
            or the total: it may evict other connections' pending bodies.
        pending_wait: a pending body waits at most this long for the budget before the
            stream is refused (``RESOURCE_EXHAUSTED``: its sender then uses gRPC).
        member_host: on a server, whether a host is a member's of a round here: a pending
            body from it that misses the fixed pace is held to a member's rule instead
            (the first message of a resumed stream carries a chunk).
        """
        self._admit = admit
        self._budget = budget
        self._congestion_control = congestion_control
        self._make_room = make_room
        self._pending_wait = pending_wait
        self._member_host = member_host
        self._host = ""  # the client's address, on a server
        self.range_key = ""
        """The address range (or exempt host) this connection's bytes count against."""
        self.standing = Standing.PENDING
        self._member = ""  # hex peer id, once MEMBER
        self._body_accounts: tuple[Account, ...] = ()  # what the body being read is charged to
        self._wanted = 0  # a declared body length waiting for the budget
        self._budget_paused = False
        self._await_admission = False  # a pending stream's first message arrived
        self._body_timer: asyncio.TimerHandle | None = None
        self._wait_timer: asyncio.TimerHandle | None = None
        self.pending_since = 0
        """Admission order of this connection's oldest pending body (eviction picks the
        oldest of a range)."""
        self.transport: asyncio.Transport | None = None
        self._head = bytearray(HEAD.size)
        self._body: np.ndarray | None = None
        self._kind = 0
        self._filled = 0
        self._frames: collections.deque[tuple[int, memoryview, tuple[Account, ...]]] = (
            collections.deque()
        )
        self._waiter: asyncio.Future[None] | None = None
        self._writable: asyncio.Future[None] | None = None
        self._queued_bytes = 0
        self._reading_paused = False
        self.reject = False
        """Refuse the connection (the server is at its limit, or evicted it): a
        ``RESOURCE_EXHAUSTED`` status was sent, what arrives is discarded, and the
        connection closes when the client does or :data:`END_WAIT` later."""
        self.error: Exception | None = None
        self.closed = asyncio.Event()
        self.peer_id: bytes | None = None
        """On a TLS connection, the peer id of the other side's verified credential."""
        self.streams = 0
        """Streams begun on this connection (server side)."""
        self.restarts = 0
        """Times its congestion control was restarted for a stream on the reused connection."""
        self._default_algorithm = ""  # under ``auto``: the socket's algorithm when made

    # ---- asyncio callbacks ----

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        self.transport = cast(asyncio.Transport, transport)  # uvloop's is not a subclass
        self.transport.set_write_buffer_limits(high=_WRITE_HIGH, low=_WRITE_LOW)
        self._choose_congestion_control()
        ssl_object = self.transport.get_extra_info("ssl_object")
        if ssl_object is not None:  # called after the handshake: the certificate is verified
            der = ssl_object.getpeercert(binary_form=True)
            self.peer_id = peer_id_of_der(der) if der else None
        if self._admit is not None:
            peer = self.transport.get_extra_info("peername")
            host = str(peer[0]) if isinstance(peer, tuple) and peer else ""
            self._host = host
            if not self._admit(self, host):
                self.refuse("too many data connections")

    def _socket(self) -> socket.socket | None:
        return self.transport.get_extra_info("socket") if self.transport is not None else None

    def _choose_congestion_control(self) -> None:
        """Give this connection's socket its algorithm: the setting's name, or for
        ``auto`` the one for the path's round-trip time (``congestion.apply_for_path``).
        Both ends choose: each side's algorithm governs what that side sends (the chunks
        one way, the averages back). The daemon checked a name at start, so a refusal here
        is unexpected: logged, and the connection goes on with the kernel's default rather
        than failing."""
        name, sock = self._congestion_control, self._socket()
        if sock is None or name is None or name == KERNEL:
            return
        if name == AUTO:
            try:
                self._default_algorithm = get_congestion_control(sock)
            except OSError:
                return  # the connection is gone
            apply_for_path(sock, self._default_algorithm)
            return
        try:
            set_congestion_control(sock, name)
        except (CongestionControlError, OSError) as exc:
            log.warning("data plane connection keeps the default congestion control: %s", exc)

    def get_buffer(self, sizehint: int) -> memoryview:
        if self.reject:
            return memoryview(self._head)  # scratch: a refused connection's bytes are dropped
        if self._body is None:
            return memoryview(self._head)[self._filled :]
        return self._body.data[self._filled :]

    def buffer_updated(self, nbytes: int) -> None:
        if self.reject:
            return
        self._filled += nbytes
        if self._body is None:
            if self._filled < HEAD.size:
                return
            length, kind = HEAD.unpack(self._head)
            self._filled = 0
            if length > MAX_BODY or kind not in KINDS:
                self._fail(ProtocolError(f"bad frame (kind {kind}, {length} bytes)"))
                return
            self._kind = kind
            if length:
                self._admit_body(length)
                return
            self._deliver(memoryview(b""), ())
        elif self._filled == self._body.size:
            body, self._body, self._filled = self._body, None, 0
            accounts, self._body_accounts = self._body_accounts, ()
            self._cancel_timer("_body_timer")
            self._deliver(body.data, accounts)

    # ---- admission (servers) ----

    def accounts(self) -> tuple[Account, ...]:
        return accounts_for(self.standing, self.range_key, self._member)

    def pending_held(self) -> int:
        """Bytes this connection holds in the pending pool now."""
        held = sum(body.nbytes for _, body, accounts in self._frames if _is_pending(accounts))
        if self._body is not None and _is_pending(self._body_accounts):
            held += self._body.size
        return held

    def range_holding(self) -> int:
        """Bytes this connection's range holds in the pool its next body goes to (the
        order in which waiting bodies are admitted: least first)."""
        if self._budget is None:
            return 0
        kind = "pending-range" if self.standing is Standing.PENDING else "member-range"
        return self._budget.held_by((kind, self.range_key))

    def _admit_body(self, length: int) -> None:
        """Allocate the next body once the budget has its bytes (never on the header's
        word alone); until then this connection is not read."""
        if self._budget is None:
            self._body = np.empty(length, np.uint8)  # no zero-fill: recv writes it all
            return
        blocking = self._budget.blocking(self.accounts(), length)
        if blocking in ("pending", "total") and self._make_room is not None:
            self._make_room(self, length)
        if self._take(length):
            return
        self._wanted = length
        self._budget_paused = True
        self._update_reading()
        self._budget.wait(self._retry_body, self.range_holding)
        if self.standing is Standing.PENDING:
            loop = asyncio.get_running_loop()
            self._wait_timer = loop.call_later(self._pending_wait, self._waited_too_long)

    def _take(self, length: int) -> bool:
        if self._budget is None or not self._budget.try_acquire(self.accounts(), length):
            return False
        self._body_accounts = self.accounts()
        if self.standing is Standing.PENDING and not self.pending_held():
            self.pending_since = next(_order)
        self._body = np.empty(length, np.uint8)
        self._arm_body_timer(length)
        return True

    def _arm_body_timer(self, length: int) -> None:
        self._cancel_timer("_body_timer")
        if self.standing is Standing.MEMBER:
            self._watch_member_body()
        else:
            self._body_timer = asyncio.get_running_loop().call_later(
                BODY_GRACE + length / MIN_BODY_RATE, self._body_stalled
            )

    def _watch_member_body(self) -> None:
        """Look again after :data:`MEMBER_BODY_SILENCE` whether the body's bytes still come."""
        self._body_timer = asyncio.get_running_loop().call_later(
            MEMBER_BODY_SILENCE, self._body_progressed, self._filled
        )

    def _body_progressed(self, filled_before: int) -> None:
        """A member's body: cut it if no byte came since the last look, else look again."""
        self._body_timer = None
        if self._body is None:
            return
        if self._filled == filled_before:
            self._cut_stalled_body()
            return
        self._watch_member_body()

    def _body_stalled(self) -> None:
        self._body_timer = None
        if self._body is None:
            return
        if self.standing is Standing.MEMBER or (
            self._member_host is not None and self._member_host(self._host)
        ):
            # Admitted since the body began, or a member's connection whose stream is not
            # admitted yet (the first message of a resumed stream carries a chunk): as
            # slow as the member's link may be.
            self._watch_member_body()
            return
        self._cut_stalled_body()

    def _cut_stalled_body(self) -> None:
        if self._body is not None:
            self._fail(BodyStalled(f"a {self._body.size}-byte frame body stalled"))

    def _waited_too_long(self) -> None:
        self._wait_timer = None
        if self._wanted and self.standing is Standing.PENDING:
            self.refuse("data plane busy")

    def _cancel_timer(self, name: str) -> None:
        timer = getattr(self, name)
        if timer is not None:
            timer.cancel()
            setattr(self, name, None)

    def _retry_body(self) -> bool:
        if self._budget is None or self.error is not None or not self._wanted:
            return True  # closed meanwhile: stop waiting
        if not self._take(self._wanted):
            return False
        self._wanted = 0
        self._budget_paused = False
        self._cancel_timer("_wait_timer")
        self._update_reading()
        return True

    def admitted(self, peer_id: bytes) -> None:
        """The current stream serves a round here, sent by member ``peer_id``: its bytes,
        held and to come, count against that member and the main pool from now on."""
        if self.standing is Standing.MEMBER and self._member == peer_id.hex():
            return
        old = self.accounts()
        self.standing, self._member = Standing.MEMBER, peer_id.hex()
        new = self.accounts()
        self._cancel_timer("_wait_timer")
        if self._budget is not None:
            moved = [i for i, f in enumerate(self._frames) if f[2] == old]
            for i in moved:
                kind, body, _ = self._frames[i]
                self._frames[i] = (kind, body, new)
            nbytes = sum(self._frames[i][1].nbytes for i in moved)
            if self._body is not None and self._body_accounts == old:
                nbytes += self._body.size
                self._body_accounts = new
            self._budget.charge(new, nbytes)
            self._budget.release(old, nbytes)
        self._await_admission = False
        self._update_reading()

    def begin_stream(self) -> None:
        """A new stream starts on this connection: pending until :meth:`admitted`."""
        self.standing, self._member = Standing.PENDING, ""
        self.streams += 1
        if self.streams > 1:
            self.reused()

    def reused(self) -> None:
        """A stream begins on this connection after another: under ``auto``, choose the
        algorithm again from the path's round-trip time as measured so far; then restart
        its state where it is BBR (``congestion.restart_congestion_control``; a switch to
        another algorithm starts that one afresh anyway). Both ends call it, each for what
        it sends."""
        sock = self._socket()
        if sock is None:
            return
        if self._congestion_control == AUTO:
            try:
                before = get_congestion_control(sock)
            except OSError:
                return  # the connection is gone
            if apply_for_path(sock, self._default_algorithm or before) != before:
                return
        if restart_congestion_control(sock):
            self.restarts += 1

    def refuse(self, details: str) -> None:
        """Refuse this connection's stream with ``RESOURCE_EXHAUSTED`` before any of it
        was processed, give back every byte it holds, and drain it until it closes (so
        that the client reads the status and uses gRPC). Idempotent."""
        if self.transport is None or self.reject:
            return
        self.reject = True
        if self.error is None:
            self.error = ConnectionAbortedError(f"refused: {details}")
        self._drop_held()
        body = status_body(grpc.StatusCode.RESOURCE_EXHAUSTED, details)
        if not self.transport.is_closing():
            # Closing at once, with the client's bytes unread, would reset the connection
            # and lose the status: read and drop until it closes, END_WAIT at most.
            self.transport.writelines([HEAD.pack(len(body), STATUS), body])
            if self._reading_paused:
                self._reading_paused = False
                self.transport.resume_reading()
            asyncio.get_running_loop().call_later(END_WAIT, self.transport.abort)
        self._wake()

    def _drop_body(self) -> None:
        """Give back the bytes of the body being read (or stop waiting for them)."""
        self._cancel_timer("_body_timer")
        self._cancel_timer("_wait_timer")
        self._wanted = 0
        if self._budget is not None:
            self._budget.forget(self._retry_body)
            if self._body is not None:
                self._budget.release(self._body_accounts, self._body.size)
        self._body, self._body_accounts = None, ()

    def _drop_held(self) -> None:
        """Give back the bytes of the body being read and of every queued frame."""
        self._drop_body()
        frames, self._frames = self._frames, collections.deque()
        self._queued_bytes = 0
        if self._budget is not None:
            for _, body, accounts in frames:
                self._budget.release(accounts, body.nbytes)

    # ---- flow control ----

    def _update_reading(self) -> None:
        """Read the socket unless the frame queue is full, a body waits for the budget,
        or a pending stream's first message waits for its admission."""
        paused = self._budget_paused or self._await_admission or self._over_high_water()
        if self.transport is None or self.reject or paused == self._reading_paused:
            return
        self._reading_paused = paused
        if paused:
            self.transport.pause_reading()
        elif not self.transport.is_closing():
            self.transport.resume_reading()

    def _deliver(self, body: memoryview, accounts: tuple[Account, ...]) -> None:
        self._frames.append((self._kind, body, accounts))
        self._queued_bytes += body.nbytes
        if self._kind == MSG and accounts and self.standing is Standing.PENDING:
            self._await_admission = True  # one message per stream before it is admitted
        self._update_reading()
        self._wake()

    def _over_high_water(self) -> bool:
        return len(self._frames) >= _QUEUE_HIGH_FRAMES or self._queued_bytes >= _QUEUE_HIGH_BYTES

    def eof_received(self) -> bool:
        self._fail(ConnectionResetError("connection closed by the other side"))
        return False

    def connection_lost(self, exc: Exception | None) -> None:
        self._fail(exc or ConnectionResetError("connection closed"))
        self.closed.set()
        # The body being read is lost; frames queued before stay readable (and charged)
        # until taken or discarded.
        self._drop_body()
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    def pause_writing(self) -> None:
        if self._writable is None or self._writable.done():
            self._writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self._writable is not None and not self._writable.done():
            self._writable.set_result(None)

    # ---- used by streams ----

    def _fail(self, error: Exception) -> None:
        if self.error is None:
            self.error = error
        if self.transport is not None and not self.reject:
            self.transport.close()
        self._wake()

    def _wake(self) -> None:
        if self._waiter is not None and not self._waiter.done():
            self._waiter.set_result(None)

    @property
    def usable(self) -> bool:
        return self.error is None and self.transport is not None and not self.transport.is_closing()

    async def next_frame(self) -> tuple[int, memoryview]:
        """The next frame; raises the connection's error once no frame is left."""
        await self.wait_for_frame()
        kind, body, accounts = self._frames.popleft()
        self._queued_bytes -= body.nbytes
        if self._budget is not None and accounts:
            self._budget.release(accounts, body.nbytes)
        self._update_reading()
        return kind, body

    def send(self, kind: int, pieces: Sequence[bytes | memoryview]) -> None:
        """Queue one frame (never blocks; :meth:`drain` waits for room)."""
        if not self.usable or self.transport is None:
            raise self.error or ConnectionResetError("connection closed")
        size = sum(memoryview(p).nbytes for p in pieces)
        self.transport.writelines([HEAD.pack(size, kind), *pieces])

    @property
    def write_paused(self) -> bool:
        """Whether :meth:`drain` would wait (the transport's buffer is over its mark)."""
        return self._writable is not None and not self._writable.done()

    @property
    def frame_ready(self) -> bool:
        """Whether :meth:`next_frame` returns without waiting (a frame is queued)."""
        return bool(self._frames)

    async def drain(self) -> None:
        if self._writable is not None and not self._writable.done():
            await self._writable
        if self.error is not None:
            raise self.error

    async def wait_for_frame(self) -> None:
        """Wait until a frame is buffered (not taking it), or raise the connection's error."""
        while not self._frames:
            if self.error is not None:
                raise self.error
            self._waiter = asyncio.get_running_loop().create_future()
            try:
                await self._waiter
            finally:
                self._waiter = None

    def discard_buffered(self) -> None:
        """Drop every queued frame and give its bytes back to the budget (the server
        calls this when it stops serving the connection)."""
        self._drop_held()

    def close(self, *, discard: bool = False) -> None:
        """Close the connection; ``discard`` drops unsent bytes instead of flushing them
        (a sender's unsent chunks may be views of its caller's tensors). A refused
        connection closes itself once its status was read (see :meth:`refuse`)."""
        if self.transport is None:
            return
        if discard:
            self.transport.abort()
        elif not self.reject:
            self.transport.close()
