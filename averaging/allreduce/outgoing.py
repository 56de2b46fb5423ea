"""What this member sends in a round: its values, chunk by chunk, through the codec.

A :class:`Contribution` codes each chunk of the flattened tensors for the reducer of its
part: the chunks of another member's part as the wire pieces of a keyed ``Reduce``
stream, each sealed with the stream's tag (:meth:`Contribution.request`) after the
stream's signed opening (:meth:`Contribution.opening`), the chunks of our own part
through the codec and back into our own reducer (:meth:`Contribution.contribute_local`).
The coding runs in the service's executor; a chunk of our own values that holds NaN/Inf
ends the round (:attr:`Contribution.non_finite`).
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import TypeVar

import numpy as np

from swarmavg.averaging.allreduce.keyed_stream import SenderHandshake
from swarmavg.averaging.allreduce.member_side import MemberSide
from swarmavg.averaging.allreduce.round import ReducerRound, offload
from swarmavg.averaging.allreduce.stream_mac import StreamMac
from swarmavg.averaging.allreduce.stream_resume import Resumption
from swarmavg.averaging.allreduce.wire import OutgoingChunk, encode_request, sealed
from swarmavg.averaging.errors import InvalidTensorsError
from swarmavg.compression import CodecInfo
from swarmavg.compression.kernels import all_finite
from swarmavg.dht.auth import RequestSigner

__all__ = ["Contribution"]

_T = TypeVar("_T")


class Contribution:
    """This member's values in one round, coded chunk by chunk for their reducers.

    Args:
        side: this member's side of the round.
        weight: this member's weight, sent in the opening of every stream.
        signer: signs each stream's opening for the reducer it goes to.
        codec_checks: the codec checks our values for NaN/Inf as it codes them (the
            runner's ``FiniteCheck.AS_ENCODED``, where nothing else checks them).
    """

    def __init__(
        self, side: MemberSide, weight: float, signer: RequestSigner, codec_checks: bool
    ) -> None:
        self.side = side
        self.weight = weight
        self.signer = signer
        self.codec_checks = codec_checks
        self.non_finite = asyncio.Event()
        """Set when a chunk of our own values held NaN/Inf: the round ends."""
        self.non_finite_error: InvalidTensorsError | None = None
        """Which chunk, once :attr:`non_finite` is set."""

    def handshake(self, part: int, resumption: Resumption | None) -> SenderHandshake:
        """A fresh handshake for one stream to the reducer of ``part`` (one per stream: a
        stream asked again gets a new key), resuming with ``resumption`` when given."""
        group = self.side.group
        return SenderHandshake(
            self.signer.peer_id, group.members[part].peer_id, group.group_id, part, resumption
        )

    def opening(
        self, handshake: SenderHandshake, stripe: int = 0, stripes: int = 1
    ) -> OutgoingChunk:
        """The stream's first message: our weight, the stream's key and which of our
        ``stripes`` streams to the reducer it is, no chunk."""
        # Signed for part's reducer and this group: a captured first message opens no
        # stream to another reducer, into another group, or twice (dht/auth.py).
        return handshake.opening(self.signer, self.weight, stripe, stripes)

    async def request(self, part: int, chunk: int, mac: StreamMac) -> OutgoingChunk | None:
        """``chunk`` of ``part`` as the wire pieces of its ``ReduceRequest``, coded in the
        executor and sealed with ``mac``'s next tag; ``None`` when our values refused
        coding (the round ends)."""
        try:
            return await offload(
                self.side.executor,
                self._encode_request,
                part,
                chunk,
                mac,
                elements=self.side.plan.chunk_size(part, chunk),
            )
        except InvalidTensorsError as e:
            self._stop_non_finite(e)
            return None

    async def contribute_local(self, round_: ReducerRound) -> None:
        """Hand our own reducer our values of its part, each chunk through the codec and
        back (so our copy is what the others' copies are: decoded)."""
        for chunk in range(self.side.plan.num_chunks(self.side.my_index)):
            try:
                values = await offload(
                    self.side.executor,
                    self._round_trip_local,
                    chunk,
                    elements=self.side.plan.chunk_size(self.side.my_index, chunk),
                )
            except InvalidTensorsError as e:
                self._stop_non_finite(e)
                return
            round_.add_local(chunk, values)
            # Work run inline (no executor, or a small chunk: ``offload``) never suspends:
            # yield, so that the sends to the other reducers start now instead of after our
            # whole part was encoded.
            await asyncio.sleep(0)

    def _stop_non_finite(self, error: InvalidTensorsError) -> None:
        """End the round: our own tensors hold NaN/Inf (found as a chunk was coded)."""
        if self.non_finite_error is None:
            self.non_finite_error = error
            self.non_finite.set()

    # ---- run in the executor ----

    def _chunk(self, part: int, chunk: int) -> tuple[np.ndarray, CodecInfo]:
        """Our values of one chunk of ``part``, and what the codec is told about them."""
        span = self.side.plan.chunk_span(part, chunk)
        # Keyed by the tensors' schema and the chunk's place in them, so a stateful codec's
        # residual (top-k error feedback) meets the same slice of the same tensors next round.
        info = CodecInfo(
            key=f"{self.side.group.schema_hash.hex()[:16]}/flat[{span.start}:{span.stop}]",
            part_index=part,
            part_size=self.side.plan.part_size(part),
            finite=not self.codec_checks,
        )
        return self.side.vector[span], info

    @staticmethod
    def _coded(
        code: Callable[[np.ndarray, CodecInfo], _T], values: np.ndarray, info: CodecInfo
    ) -> _T:
        """``code(values, info)``, where a refusal caused by NaN/Inf in our own unchecked
        values becomes :class:`InvalidTensorsError` (the round ends) rather than a failed
        part."""
        try:
            return code(values, info)
        except ValueError as e:  # CodecError included
            if info.finite or all_finite(values):
                raise
            where = info.key.rpartition("/")[2]  # the chunk's place in the flattened tensors
            raise InvalidTensorsError(f"the tensors hold NaN or Inf (in elements {where})") from e

    def _encode_request(self, part: int, chunk: int, mac: StreamMac) -> OutgoingChunk:
        """One chunk of ``part`` as the wire pieces of its ``ReduceRequest``, sealed with
        the stream's next tag (here, off the loop with the encoding; a stream's chunks are
        encoded one at a time, in the order they are written)."""
        encoded = self._coded(self.side.codec.encode_payload, *self._chunk(part, chunk))
        return sealed(encode_request(encoded, chunk), mac)

    def _round_trip_local(self, chunk: int) -> np.ndarray:
        """This member's own copy of one chunk of its part, through the codec and back."""
        size = self.side.plan.chunk_size(self.side.my_index, chunk)
        values = self._coded(self.side.codec.round_trip, *self._chunk(self.side.my_index, chunk))
        if values.shape != (size,) or values.dtype != self.side.vector.dtype:
            raise ValueError(f"codec {self.side.codec.name} changed the shape or dtype of a chunk")
        return values
