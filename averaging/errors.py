"""Errors raised by the averaging layer (matchmaking, all-reduce facade, state sharing).

The daemon (``swarmavg.peer``) maps these onto its public ``SwarmError`` hierarchy; this
package does not import ``swarmavg.peer`` (docs/architecture.md, "Packages and their
direction").
"""

from __future__ import annotations


class AveragingError(Exception):
    """Base class of every error raised by ``swarmavg.averaging``."""


class InvalidRequestError(AveragingError, ValueError):
    """A caller's round parameters are invalid (key, weight, timeout, sizes, codec).

    Raised before anything is sent; the daemon keeps serving.
    """


class InvalidTensorsError(InvalidRequestError):
    """The caller's tensors cannot be averaged: empty list, unsupported dtype, NaN/Inf, ...

    Raised before anything is sent; the daemon keeps serving. (One exception: a raw
    control call that says its client checked its shared-memory inputs when it did not
    finds out mid-round, and its group goes on without it.)
    """


class NoGroupError(AveragingError):
    """Fewer than ``min_group_size`` peers could be gathered before the deadline."""


class RoundClosedError(NoGroupError):
    """No group for this peer because the round under its key already closed without it:
    the group it belonged to averaged before it joined, and nobody else is looking.

    A :class:`NoGroupError` (code that catches that one is unchanged), told apart so that a
    training wrapper knows the others *are* stepping this round: it waits for their step
    and adopts it rather than stepping alone (docs/training.md, "when a member is waited
    for").
    """


class SchemaMismatchError(AveragingError, ValueError):
    """Peers averaging under the same key hold tensors of different shapes or dtypes.

    Raised instead of :class:`NoGroupError` when the only peers found had another schema,
    so the message names the cause (different model, different tensor list) rather than
    "nobody came".
    """


class MatchmakingError(AveragingError):
    """Matchmaking failed for a reason other than too few peers (a protocol violation)."""


class DataPlaneBindError(AveragingError):
    """The data plane cannot listen on the port the user chose (``--data-port``); with port 0
    (any free port) the peer falls back to gRPC instead."""


class StateNotFoundError(AveragingError):
    """No peer in the run advertises published state."""


class StateDownloadError(AveragingError):
    """Published state exists but no donor delivered a complete, hash-verified copy."""


__all__ = [
    "AveragingError",
    "InvalidRequestError",
    "InvalidTensorsError",
    "MatchmakingError",
    "NoGroupError",
    "RoundClosedError",
    "SchemaMismatchError",
    "StateDownloadError",
    "StateNotFoundError",
]
