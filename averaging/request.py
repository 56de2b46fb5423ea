"""One averaging round as a caller asked for it: validated once, then passed down unchanged.

A :class:`RoundRequest` is built where a call enters (the client before it sends, the
daemon's control service when the call arrives, :meth:`Averager.average` for in-process
callers), once per process, and handed as it is to the local combiner, matchmaking and the
all-reduce. Between the client and the daemon it travels as the ``AverageStart`` fields of
:meth:`RoundRequest.wire_fields`, which the daemon checks again (:meth:`RoundRequest.from_wire`):
what arrives from another process is not trusted. Nothing
below the boundary checks it again, and its ``deadline`` is an instant on
``time.monotonic()``: the relative timeout a caller gives is turned into it exactly once.

The tensors travel beside the request, not in it: the local combiner merges several
callers' tensors into one contribution under one request. Their rules live here too
(:func:`check_tensors`, :func:`check_finite`), so every boundary applies the same ones.
"""

from __future__ import annotations

import math
import numbers
import time
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeGuard

import numpy as np

from swarmavg.averaging.aggregation import MEAN, canonical_aggregation
from swarmavg.averaging.errors import InvalidRequestError, InvalidTensorsError
from swarmavg.averaging.group import MAX_GROUP_SIZE
from swarmavg.compression import get_codec
from swarmavg.compression.dtypes import FLOATING, SUPPORTED
from swarmavg.compression.kernels import all_finite

MAX_KEY_BYTES = 256
"""Longest round key; keys end up inside DHT keys (``{run}.{key}.{bits}``), capped at 512."""
MAX_STATE_DIGEST_BYTES = 64
"""Longest state digest a caller may attach (a blake2b digest is 32 bytes, sha512 64)."""
STATE_DIGEST_TAG = b"\x00swarmavg.state-digest.v1\x00"
"""Marks a member's ``user_data`` as a state digest, so that the opaque ``user_data`` of a
daemon configured with one (``AveragerConfig.user_data``) is never taken for a digest."""


@dataclass(frozen=True)
class RoundRequest:
    """The parameters of one round, checked.

    Attributes:
        key: what is averaged (e.g. ``"step-42"``); peers meet under the same key.
        weight: this contribution's weight, finite and > 0 (>= 0 for in-process callers).
        deadline: ``time.monotonic()`` instant by which the whole call ends.
        group_size: the members a group waits for, and the most it holds unless
            ``max_group_size`` says more; ``None``: the daemon's default.
        max_group_size: the most members a group may hold, above ``group_size``: room
            for peers the caller did not know of when it counted ``group_size`` (the
            training wrappers count the swarm from progress records, which a newcomer's
            reaches some members later than others); ``None``: ``group_size``.
        min_group_size: the fewest members with which a group may close.
        codec: codec (name and parameters, as :func:`~swarmavg.compression.get_codec` takes
            them) of groups this peer leads; ``None``: the daemon's default.
        state_digest: a digest of the caller's shared state (at most
            :data:`MAX_STATE_DIGEST_BYTES`), handed to every member of the group, which
            returns every member's digest with the result; empty: none attached.
        aggregation: the canonical name of the aggregation rule
            (:mod:`swarmavg.averaging.aggregation`); only peers asking for the same rule
            average together.
    """

    key: str
    weight: float
    deadline: float
    group_size: int | None = None
    min_group_size: int = 2
    max_group_size: int | None = None
    codec: str | None = None
    state_digest: bytes = b""
    aggregation: str = MEAN

    @classmethod
    def build(
        cls,
        *,
        key: object,
        weight: object = 1.0,
        timeout: object = 30.0,
        group_size: object = None,
        min_group_size: object = 2,
        codec: object = None,
        state_digest: object = None,
        aggregation: object = None,
        max_group_size: object = None,
        now: float | None = None,
        allow_zero_weight: bool = False,
    ) -> RoundRequest:
        """Check a caller's arguments and fix the deadline at ``now + timeout``.

        Args:
            now: the ``time.monotonic()`` instant the call started (default: now).
            aggregation: ``"mean"`` (``None``), ``"centered-clip"`` or ``"trimmed-mean"``,
                with parameters in the name (``"centered-clip:tau=1.0,iters=5"``).
            allow_zero_weight: accept weight 0 (a member that takes the average without
                adding to it). In-process callers may; the client API refuses it, since a
                group whose weights are all 0 has no mean.

        Raises:
            InvalidRequestError: a bad argument, named in the message (an unknown codec's
                message lists the known ones).
        """
        if not isinstance(key, str) or not key:
            raise InvalidRequestError(f"key must be a non-empty string, got {key!r}")
        size = len(key.encode("utf-8", "surrogatepass"))
        if size > MAX_KEY_BYTES:
            raise InvalidRequestError(f"key is {size} bytes long; the limit is {MAX_KEY_BYTES}")
        if (
            not _is_number(weight)
            or not math.isfinite(weight)
            or weight < 0
            or (weight == 0 and not allow_zero_weight)
        ):
            bound = ">= 0" if allow_zero_weight else "> 0"
            raise InvalidRequestError(f"weight must be a finite number {bound}, got {weight!r}")
        if not _is_number(timeout) or not math.isfinite(timeout) or timeout <= 0:
            raise InvalidRequestError(
                f"timeout must be a finite number of seconds > 0, got {timeout!r}"
            )
        size_limit = _as_int(group_size, "group_size") if group_size is not None else None
        min_size = _as_int(min_group_size, "min_group_size")
        if size_limit is not None and min_size > size_limit:
            raise InvalidRequestError(
                f"min_group_size {min_size} is larger than group_size {size_limit}"
            )
        cap = _as_int(max_group_size, "max_group_size") if max_group_size is not None else None
        if cap is not None:
            if size_limit is None:
                raise InvalidRequestError(
                    "max_group_size needs a group_size (the members to wait for)"
                )
            if cap < size_limit:
                raise InvalidRequestError(
                    f"max_group_size {cap} is smaller than group_size {size_limit}"
                )
        if codec is not None:
            if not isinstance(codec, str) or not codec or len(codec) > 64:
                raise InvalidRequestError(f"codec must be None or a codec name, got {codec!r}")
            try:
                get_codec(codec)  # kept as given: its parameters ("topk:fraction=0.05") count
            except ValueError as exc:  # the registry's message lists the known names
                raise InvalidRequestError(str(exc)) from None
        digest = _as_digest(state_digest)
        try:  # kept canonical: "centered-clip" and "centered-clip:tau=1.0" are one rule
            rule = MEAN if aggregation is None else canonical_aggregation(aggregation)
        except ValueError as exc:  # the message lists the known rules and parameters
            raise InvalidRequestError(str(exc)) from None
        start = time.monotonic() if now is None else now
        return cls(
            key=key,
            weight=float(weight),
            deadline=start + float(timeout),
            group_size=size_limit,
            min_group_size=min_size,
            max_group_size=cap,
            codec=codec,
            state_digest=digest,
            aggregation=rule,
        )

    def wire_fields(self, timeout: float) -> dict[str, Any]:
        """This request as the control protocol's ``AverageStart`` fields of the same names,
        ``None`` sent as the field's zero value; :meth:`from_wire` reads them back.

        Args:
            timeout: the caller's timeout in seconds: the daemon fixes the deadline on its
                own clock when the call arrives.
        """
        return {
            "key": self.key,
            "weight": self.weight,
            "timeout": timeout,
            "group_size": self.group_size or 0,
            "min_group_size": self.min_group_size,
            "max_group_size": self.max_group_size or 0,
            "codec": self.codec or "",
            "state_digest": self.state_digest,
            "aggregation": self.aggregation,
        }

    @classmethod
    def from_wire(cls, message: Any, now: float) -> RoundRequest:
        """Check a request that arrived as :meth:`wire_fields` (an ``AverageStart``): its
        sender is another process, so every field is checked as :meth:`build` checks a
        caller's arguments, and the deadline is ``now + timeout`` on this process's clock.

        Raises:
            InvalidRequestError: as :meth:`build`.
        """
        return cls.build(
            key=message.key,
            weight=message.weight,
            timeout=message.timeout,
            group_size=message.group_size or None,
            min_group_size=message.min_group_size,
            max_group_size=message.max_group_size or None,
            codec=message.codec or None,
            state_digest=message.state_digest or None,
            aggregation=message.aggregation or None,
            now=now,
        )

    def user_data(self, default: bytes) -> bytes:
        """What this round hands the group as this member's ``user_data``: the tagged state
        digest when one is attached, else ``default`` (the daemon's configured bytes)."""
        return STATE_DIGEST_TAG + self.state_digest if self.state_digest else default

    def remaining(self) -> float:
        """Seconds left until :attr:`deadline` (negative once it passed)."""
        return self.deadline - time.monotonic()


def check_tensors(tensors: object) -> list[np.ndarray]:
    """Check the types and dtypes of a caller's tensors (cheap: no pass over the values).

    Returns read-only views, so a round can never write into the caller's arrays.

    Raises:
        InvalidTensorsError: not a non-empty list of numpy arrays of a wire dtype
            (:data:`swarmavg.compression.dtypes.SUPPORTED`).
    """
    if isinstance(tensors, np.ndarray) or not isinstance(tensors, Sequence):
        raise InvalidTensorsError("tensors must be a list of numpy arrays")
    if len(tensors) == 0:
        raise InvalidTensorsError("nothing to average: the tensor list is empty")
    views = []
    for i, array in enumerate(tensors):
        if not isinstance(array, np.ndarray):
            raise InvalidTensorsError(f"tensor {i} is a {type(array).__name__}, not a numpy array")
        if np.dtype(array.dtype) not in SUPPORTED:
            raise InvalidTensorsError(
                f"tensor {i} has unsupported dtype {array.dtype}; supported: "
                f"{', '.join(SUPPORTED.names)}"
            )
        view = array.view()
        view.flags.writeable = False
        views.append(view)
    return views


def check_finite(arrays: Sequence[np.ndarray]) -> None:
    """Reject NaN and Inf, which would poison the whole group's average.

    One pass over every floating element: run it off the event loop
    (``asyncio.to_thread``) for anything but small inputs.

    Raises:
        InvalidTensorsError: naming the first tensor that holds one, and how many.
    """
    for i, array in enumerate(arrays):
        if np.dtype(array.dtype) in FLOATING and not all_finite(array):
            bad = int(np.size(array) - np.count_nonzero(np.isfinite(array)))
            raise InvalidTensorsError(f"tensor {i} holds {bad} NaN/Inf value(s)")


def _is_number(value: object) -> TypeGuard[numbers.Real]:
    return isinstance(value, numbers.Real) and not isinstance(value, bool)


def digests_from_user_data(gathered: Mapping[str, bytes]) -> dict[str, bytes]:
    """The state digests among the members' ``user_data`` (peer id hex -> digest).

    Members whose ``user_data`` carries no tagged digest, or an over-long one (a member's
    entry comes from the group's leader), are left out.
    """
    digests: dict[str, bytes] = {}
    for peer, data in gathered.items():
        if data.startswith(STATE_DIGEST_TAG):
            digest = data[len(STATE_DIGEST_TAG) :]
            if 0 < len(digest) <= MAX_STATE_DIGEST_BYTES:
                digests[peer] = bytes(digest)
    return digests


def _as_digest(value: object) -> bytes:
    """``value`` as state digest bytes (``None``: none); ``InvalidRequestError`` otherwise."""
    if value is None:
        return b""
    if not isinstance(value, bytes | bytearray | memoryview):
        raise InvalidRequestError(f"state_digest must be bytes or None, got {type(value).__name__}")
    digest = bytes(value)
    if len(digest) > MAX_STATE_DIGEST_BYTES:
        raise InvalidRequestError(
            f"state_digest is {len(digest)} bytes long; the limit is {MAX_STATE_DIGEST_BYTES}"
        )
    return digest


def _as_int(value: object, name: str) -> int:
    """``value`` as a group size in 1..MAX_GROUP_SIZE; ``InvalidRequestError`` otherwise."""
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise InvalidRequestError(f"{name} must be an int, got {value!r}")
    if not 1 <= int(value) <= MAX_GROUP_SIZE:
        raise InvalidRequestError(f"{name} must be in 1..{MAX_GROUP_SIZE}, got {value!r}")
    return int(value)
