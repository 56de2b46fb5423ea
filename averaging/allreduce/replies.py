"""What comes back in a round, and whether to trust it: the result being assembled.

A :class:`ResultAssembly` takes the averaged chunks the reducers return (and our own
reducer's), checks each before it is written into the result, and decides which reducers
to distrust: one that answers inconsistently (more senders than the group has, or than it
can have heard from: ``num_senders`` counting this member for a chunk it had not sent yet;
a chunk out of range, twice, of the wrong size or codec) is refused for its whole part,
which keeps this member's local values. Under a robust rule, the part check
(:mod:`~swarmavg.averaging.allreduce.part_check`) refuses the parts whose averages lie too
far from our values against the others. A reducer whose stream fails its handshake or a
reply's tag (streams.py) is distrusted the same way. What the result reports comes from what this
member observed itself, not from the reducers' word.

Replies decode straight into the result in executor threads: see :meth:`ResultAssembly.seal`.
"""

from __future__ import annotations

import logging
import threading

import numpy as np

from swarmavg.averaging.allreduce.buffers import BufferPool
from swarmavg.averaging.allreduce.member_side import MemberSide
from swarmavg.averaging.allreduce.memory import copy_into, same_vector
from swarmavg.averaging.allreduce.part_check import DeviationTally, forged_parts
from swarmavg.averaging.allreduce.round import offload
from swarmavg.averaging.allreduce.wire import Reply
from swarmavg.averaging.errors import InvalidTensorsError
from swarmavg.compression.base import Buffer, Header
from swarmavg.compression.kernels import all_finite, check_copy

log = logging.getLogger(__name__)

__all__ = ["ResultAssembly"]


class ResultAssembly:
    """The result of one round as the replies fill it, with what this member observed.

    Args:
        side: this member's side of the round.
        result: where the averages go: new memory, the caller's ``out``, or the side's
            ``vector`` itself (in place).
        deviation_factor: the part check's factor; ``None``: the check is off.
        backup: when :meth:`wants_backup`, a buffer laid out like the side's ``vector``
            (:attr:`backup`); ``None`` otherwise.
        buffers: where :attr:`backup` goes back to.
    """

    def __init__(
        self,
        side: MemberSide,
        result: np.ndarray,
        deviation_factor: float | None,
        backup: np.ndarray | None,
        buffers: BufferPool,
    ) -> None:
        self.side = side
        self.result = result
        self.buffers = buffers
        group, plan = side.group, side.plan
        self.received = {j: np.zeros(plan.num_chunks(j), dtype=bool) for j in range(group.size)}
        self.full_chunks = {j: 0 for j in range(group.size)}  # averaged over every sender
        self.adjusted = {j: 0 for j in range(group.size)}  # inputs clipped/trimmed, per part
        self.weights_clipped = {j: 0 for j in range(group.size)}  # as each reducer said
        self.distrusted: dict[int, str] = {}  # part -> why its reducer's word is refused
        self.unconfirmed_ends: dict[int, str] = {}  # part -> how its stream ended untagged
        self.bytes_received = 0
        # How far each part's averages are from our own values (part_check), counted as
        # they are decoded; None: the check is off. Only under a robust rule: under the
        # mean any member bends every part by what it sends, so a run that admits
        # strangers chooses a robust rule, and the check completes it at the reducers.
        self.deviation_factor = deviation_factor
        self.tallies = {j: DeviationTally() for j in range(group.size)}
        self.in_place = same_vector(result, side.vector)
        """``result`` is ``vector``'s memory: a chunk's local values are gone once its
        average is written, so a reply is checked whole before it is written."""
        self.keep_backups = backup is not None
        """In place with the part check on (:meth:`wants_backup`): see :attr:`backup`."""
        self.backup = backup
        """In place with the check on: where our values of each chunk of the other
        members' parts are kept (at the chunk's own offset), written in the pass that
        writes its average over them, until every part was checked: a refused part gets
        them back (:meth:`fill_missing`). Our own part is never refused and keeps none.
        Kept, not the averages held back: the averages are written as they come, as
        without the check, and the pass that writes them reads our values anyway."""
        self.backed_up: set[tuple[int, int]] = set()  # (part, chunk) held in `backup`
        # Replies decode straight into `result` in executor threads, which outlive the
        # round's cancelled tasks: the lock lets fill_missing() wait for a decode in
        # flight, and `_sealed` keeps any later one from writing over the final result.
        self._result_lock = threading.Lock()
        self._sealed = False

    @staticmethod
    def wants_backup(
        vector: np.ndarray, result: np.ndarray, deviation_factor: float | None
    ) -> bool:
        """Whether a round needs :attr:`backup`: in place, with the part check on."""
        return deviation_factor is not None and same_vector(result, vector)

    # ---- replies from the other members' reducers ----

    async def accept_reply(self, part: int, reply: Reply, handed: bool) -> bool:
        """Validate and store one averaged chunk of ``part``; ``handed``: whether our copy
        of that chunk was given to its stream yet. ``False`` means "stop trusting it"."""
        chunk = reply.chunk_index
        if reply.error:
            log.warning("part %d: %s", part, reply.error)
            return False
        if chunk >= self.side.plan.num_chunks(part) or self.received[part][chunk]:
            return self.distrust(part, f"chunk {chunk} out of range or twice")
        self.bytes_received += reply.nbytes
        # The most senders an honest reducer can have averaged the chunk over: every
        # sender of the group, less this member if it had not sent that chunk yet.
        senders = len(self.side.group.senders)
        bound = senders if handed else senders - 1
        if reply.num_senders > bound:
            return self.distrust(
                part, f"chunk {chunk} claims {reply.num_senders} senders, at most {bound} possible"
            )
        if reply.num_senders == 0:
            return True  # nobody delivered this chunk in time: it stays local
        try:
            await offload(
                self.side.executor,
                self._decode_reply,
                part,
                reply,
                elements=self.side.plan.chunk_size(part, chunk),
            )
        except ValueError as e:  # CodecError included
            return self.distrust(part, f"invalid chunk {chunk}: {e}")
        self.received[part][chunk] = True
        if reply.num_senders >= senders:
            self.full_chunks[part] += 1
        self.adjusted[part] += reply.num_adjusted
        self.weights_clipped[part] = max(self.weights_clipped[part], reply.weights_clipped)
        return True

    def distrust(self, part: int, reason: str) -> bool:
        """Refuse everything the reducer of ``part`` returned: the whole part keeps local
        values (``fill_missing``) and counts as not averaged. Returns ``False``.

        In place (:attr:`in_place`) with the part check off, the chunks it returned before
        are already written over their local values, which are gone: they keep the
        averages, each of which passed every check on its own, and only the rest of the
        part stays local. The part still counts as distrusted and not averaged, the result
        as partial. With the check on, their local values come back from
        :attr:`backup`."""
        log.warning(
            "part %d: reducer %s answered inconsistently (%s); keeping local values",
            part,
            self._reducer(part),
            reason,
        )
        self.distrusted.setdefault(part, reason)
        if not self.in_place or self.keep_backups:
            self.received[part][:] = False
        self.full_chunks[part] = 0
        return False

    def end_unconfirmed(self, part: int, reason: str) -> None:
        """Record that the stream of ``part`` ended early with no end its reducer tagged.
        The averages that came before it each passed their tag and are kept; the rest of
        the part stays local (``fill_missing``), and the part counts as not averaged."""
        log.warning(
            "part %d: reducer %s: %s; keeping local values for the rest",
            part,
            self._reducer(part),
            reason,
        )
        self.unconfirmed_ends.setdefault(part, reason)

    def _reducer(self, part: int) -> str:
        """The reducer of ``part``, for logs (its id's first 12 hex digits)."""
        return self.side.group.members[part].peer_id.hex()[:12]

    def _decode_reply(self, part: int, reply: Reply) -> None:
        """Decode one averaged chunk of ``part`` into the result; ``ValueError`` if bad."""
        if reply.header is None or reply.payload is None:
            raise ValueError("reply carries no chunk")
        if not self.side.codec.accepts(reply.header.codec):
            raise ValueError(f"reply uses codec {reply.header.codec!r}")
        span = self.side.plan.chunk_span(part, reply.chunk_index)
        size = span.stop - span.start
        header = reply.header
        if header.shape != (size,) or header.dtype != self.side.vector.dtype:
            raise ValueError(
                f"reply declares {header.dtype}{list(header.shape)}, "
                f"expected {self.side.vector.dtype}[{size}]"
            )
        values = self.result[span]
        if self.deviation_factor is not None:
            self._decode_checked(part, reply.chunk_index, header, reply.payload, values)
            return
        if self.in_place and not self.side.codec.decodes_into_cleanly:
            # The local values live where the average goes: decode and check the whole
            # chunk first (codec none: a checked view of the payload, no copy), so that
            # a bad reply leaves them as they were; then one copy that cannot fail.
            decoded = self.side.codec.decode_payload(header, reply.payload).reshape(-1)
            if not self.side.codec.decodes_finite and not all_finite(decoded):
                raise ValueError("reply holds NaN or Inf")
            with self._result_lock:
                if self._sealed:
                    raise ValueError("the round is over")
                copy_into(values, decoded)
            return
        # Straight into the result: if this raises, the chunk stays unreceived and
        # fill_missing() puts the local values back over whatever was written (in place,
        # the codec wrote nothing: it checks the whole payload first).
        with self._result_lock:
            if self._sealed:
                raise ValueError("the round is over")
            self.side.codec.decode_payload_into(header, reply.payload, values)
            if not self.side.codec.decodes_finite and not all_finite(values):
                raise ValueError("reply holds NaN or Inf")

    def _decode_checked(
        self, part: int, chunk: int, header: Header, payload: Buffer, values: np.ndarray
    ) -> None:
        """:meth:`_decode_reply` with the part check on: the averages are copied where
        they go in the pass that counts the check's sums against our values there (and
        in place keeps those in :attr:`backup`), so the check reads nothing twice."""
        span = self.side.plan.chunk_span(part, chunk)
        own = self.side.vector[span]
        backup = self.backup[span] if self.keep_backups and self.backup is not None else None
        if self.in_place and self.side.codec.decodes_into_cleanly:
            # The codec writes only a payload it checked whole: keep our values, decode
            # over them, then count (a pass of its own; no codec of the data path does this
            # unless chosen).
            with self._result_lock:
                if self._sealed:
                    raise ValueError("the round is over")
                if backup is None:
                    raise ValueError("in place with the check on, but no backup")
                self.backed_up.add((part, chunk))
                copy_into(backup, own)
                self.side.codec.decode_payload_into(header, payload, values)
                self.tallies[part].add(values, backup)
            return
        # Unchecked where the codec can (none: a view of the payload): the pass below
        # checks every value as it copies it.
        decoded, _ = self.side.codec.decode_payload_unchecked(header, payload)
        decoded = decoded.reshape(-1)
        if decoded.dtype != values.dtype:  # float16's words: decode them (checked)
            decoded = self.side.codec.decode_payload(header, payload).reshape(-1)
        with self._result_lock:
            if self._sealed:
                raise ValueError("the round is over")
            if backup is not None:
                self.backed_up.add((part, chunk))
            finite, sums = check_copy(decoded, own, values, backup)
            if not finite:
                if backup is not None:  # in place: our values were written over
                    copy_into(values, backup)
                # out of place fill_missing() puts them back: the chunk stays unreceived
                raise ValueError("reply holds NaN or Inf")
            self.tallies[part].add_sums(sums, own.size)

    # ---- our own part ----

    def on_local_result(self, chunk: int, values: np.ndarray, contributors: int) -> None:
        """Called by the local ReducerRound with the decoded average of one chunk."""
        span = self.side.plan.chunk_span(self.side.my_index, chunk)
        own = self.side.vector[span]
        if self.deviation_factor is None:
            copy_into(self.result[span], values)
        else:  # our own part: a reference for the others, never refused (no backup)
            _, sums = check_copy(values.reshape(-1), own, self.result[span])
            self.tallies[self.side.my_index].add_sums(sums, own.size)
        self.received[self.side.my_index][chunk] = True
        if contributors == len(self.side.group.senders):
            self.full_chunks[self.side.my_index] += 1

    # ---- once the exchanges are over ----

    def seal(self) -> None:
        """Refuse every later reply (decodes in executor threads may outlive the round's
        tasks); returns once none is being decoded. Idempotent."""
        with self._result_lock:
            self._sealed = True

    def check_parts(self) -> None:
        """After :meth:`seal`: refuse the parts whose averages are too far from our own
        values against the other parts (:func:`~swarmavg.averaging.allreduce.part_check.
        forged_parts`), as from a distrusted reducer. Our own part, reduced here, is only a
        reference. A member that sends nothing has nothing to compare."""
        if (
            self.deviation_factor is None
            or not self.side.group.members[self.side.my_index].mode.sends
        ):
            return
        deviations = {}
        for part, tally in self.tallies.items():
            deviation = tally.result()
            if deviation is not None and part not in self.distrusted:
                deviations[part] = deviation
        refused = forged_parts(
            deviations,
            {self.side.my_index},
            self.deviation_factor,
            lambda part: self.tallies[part].zeros(),
            lambda parts: {part: self.tallies[part].mean_absolute() for part in parts},
        )
        for part, reason in sorted(refused.items()):
            self.distrust(part, f"forged averages: {reason}")

    def fill_missing(self) -> None:
        """Copy local values into every chunk that no reducer returned, once no reply is
        being decoded any more and none will be; in place, only into the chunks of a part
        refused after its averages were written (from :attr:`backup`)."""
        self.seal()
        if self.in_place:
            # nothing else overwrote the chunks no reducer returned: they are local
            backup = self.backup
            if backup is not None:
                for part, index in sorted(self.backed_up):
                    if not self.received[part][index]:
                        span = self.side.plan.chunk_span(part, index)
                        copy_into(self.result[span], backup[span])
                self.backup = None
                self.backed_up.clear()
                self.buffers.give(backup)
            return
        for part, received in self.received.items():
            for chunk in np.flatnonzero(~received):
                span = self.side.plan.chunk_span(part, int(chunk))
                self.result[span] = self.side.vector[span]

    def check_local_finite(self) -> None:
        """After :meth:`fill_missing`, for inputs nobody scanned before the round: raise
        :class:`InvalidTensorsError` when a chunk that kept our own values holds NaN/Inf
        (a reducer refused it, returned it empty, or never got it). A pass over the
        unaveraged chunks only."""
        for part, received in self.received.items():
            for chunk in np.flatnonzero(~received):
                span = self.side.plan.chunk_span(part, int(chunk))
                if not all_finite(self.result[span]):
                    raise InvalidTensorsError(
                        f"the tensors hold NaN or Inf (in elements "
                        f"flat[{span.start}:{span.stop}], which part {part}'s reducer "
                        "did not average)"
                    )

    def reported_parts(self) -> list[int]:
        """The parts this member reports on: every part, or only its own for a member that
        sends nothing (``AUX``)."""
        sends = self.side.group.members[self.side.my_index].mode.sends
        return [
            j
            for j in range(self.side.group.size)
            if self.side.plan.part_size(j) > 0 and (sends or j == self.side.my_index)
        ]

    def failed_parts(self) -> tuple[int, ...]:
        """The reported parts of which some chunk kept local values, or whose reducer was
        distrusted."""
        return tuple(
            j for j in self.reported_parts() if not self.received[j].all() or j in self.distrusted
        )

    def averaged_by_all(self) -> bool:
        """Whether every chunk of the reported parts was averaged over every sender."""
        return all(
            self.full_chunks[j] == self.side.plan.num_chunks(j) for j in self.reported_parts()
        )

    def local_fraction(self) -> float:
        """Share of the reported parts' elements that kept our own values (0..1)."""
        parts = self.reported_parts()
        elements = sum(self.side.plan.part_size(j) for j in parts)
        local = sum(
            self.side.plan.chunk_size(j, int(c))
            for j in parts
            for c in np.flatnonzero(~self.received[j])
        )
        return local / elements if elements else 0.0
