"""The client's exception hierarchy and its mapping from gRPC status codes (docs/peer.md).

Everything a client call raises derives from :class:`SwarmError`. The daemon reports a
failure as a gRPC status code plus a one-line reason; :func:`error_from_status` turns it
back into the matching exception on the client side, so the mapping lives in one place.
"""

from __future__ import annotations

from typing import Any

from swarmavg.averaging import errors as layer

# Each client error is also the averaging layer's error of the same meaning, so code inside
# ``swarmavg.averaging`` that sees both (the training wrappers call the client) catches one
# hierarchy without importing ``swarmavg.peer`` (docs/architecture.md, "Packages and their
# direction").


class SwarmError(layer.AveragingError):
    """Base of every error raised by the swarmavg client."""


class ValidationError(SwarmError, layer.InvalidTensorsError):
    """Bad input: unsupported dtype, NaN/Inf, empty list, key too long, layout mismatch."""


class SchemaMismatchError(ValidationError, layer.SchemaMismatchError):
    """No group formed, and the peers found under the key average another tensor layout.

    A :class:`ValidationError` (the tensors cannot be averaged with these peers), told
    apart from the caller's own bad input: it names other peers, whose layout may be the
    wrong one (the training wrappers treat it as a failed round, not as a bug).
    """


class NoGroupError(SwarmError, layer.NoGroupError):
    """Fewer than ``min_group_size`` peers were found before the call's timeout."""


class RoundClosedError(NoGroupError, layer.RoundClosedError):
    """No group because the round under the key closed (its group averaged) before this
    peer joined, and nobody else is looking: the others did step this round."""


class AveragingError(SwarmError):
    """A round failed for another reason than matchmaking (reported by the daemon)."""


class SwarmTimeoutError(SwarmError, TimeoutError):
    """The call did not finish within its timeout."""


class NoStateError(SwarmError, layer.StateNotFoundError):
    """No peer in the run has published state (``load_state``)."""


class MalformedStateError(SwarmError, layer.StateDownloadError):
    """``load_state`` got a state whose donor-supplied part cannot be decoded: metadata
    that is not one msgpack object, or a tensor layout this client refuses.

    A :class:`SwarmError`, and the averaging layer's ``StateDownloadError`` (no donor
    delivered a usable state), so the training wrappers treat it as a failed load and
    go on; the daemon keeps serving.
    """


class DaemonUnavailableError(SwarmError, ConnectionError):
    """No daemon answers at the control endpoint, or it is shutting down."""


# gRPC status code name -> exception class. The daemon picks the code with
# ``STATUS_FOR_ERROR`` below; codes not listed map to ``SwarmError``.
_ERROR_FOR_STATUS: dict[str, type[SwarmError]] = {
    "INVALID_ARGUMENT": ValidationError,
    "FAILED_PRECONDITION": NoGroupError,
    "ABORTED": AveragingError,
    "DEADLINE_EXCEEDED": SwarmTimeoutError,
    "NOT_FOUND": NoStateError,
    "UNAVAILABLE": DaemonUnavailableError,
}

STATUS_FOR_ERROR: dict[type[SwarmError], str] = {
    **{cls: code for code, cls in _ERROR_FOR_STATUS.items()},
    SchemaMismatchError: "INVALID_ARGUMENT",
    RoundClosedError: "FAILED_PRECONDITION",
}
"""Exception class -> gRPC status code name used by the daemon."""

REASON_KEY = "swarmavg-reason"
"""Trailing metadata key of a failed control call: the failure's reason label
(``schema_mismatch``, ``no_group``, ...), the same label the daemon counts it under. It
refines the status code where one code covers several causes."""

_ERROR_FOR_REASON: dict[tuple[str, str], type[SwarmError]] = {
    ("INVALID_ARGUMENT", "schema_mismatch"): SchemaMismatchError,
    ("FAILED_PRECONDITION", "round_closed"): RoundClosedError,
}


def error_from_status(
    code_name: str, details: str | None, endpoint: str, reason: str = ""
) -> SwarmError:
    """Build the exception for a failed control call.

    Args:
        code_name: the gRPC status code's name, e.g. ``"INVALID_ARGUMENT"``.
        details: the daemon's one-line reason (may be empty).
        endpoint: the control endpoint, named in messages about an absent daemon.
        reason: the daemon's reason label (trailing metadata :data:`REASON_KEY`), if any.
    """
    cls = _ERROR_FOR_REASON.get((code_name, reason)) or _ERROR_FOR_STATUS.get(code_name, SwarmError)
    message = details or code_name
    if cls is DaemonUnavailableError and not details:
        message = f"no swarmavg daemon answers at {endpoint} (start one with `swarmavg peer`)"
    elif cls is DaemonUnavailableError and "unix:" not in message and endpoint not in message:
        message = f"daemon at {endpoint} unavailable: {message}"
    return cls(message)


def error_from_rpc(exc: Any, endpoint: str) -> SwarmError:
    """Map a ``grpc.RpcError`` (sync or aio) to a :class:`SwarmError`."""
    code = exc.code()
    name = code.name if code is not None else "UNKNOWN"
    return error_from_status(name, exc.details(), endpoint, _reason_of(exc))


def _reason_of(exc: Any) -> str:
    """The reason label in a failed call's trailing metadata ("" when there is none)."""
    trailing = getattr(exc, "trailing_metadata", None)
    try:
        metadata = trailing() if callable(trailing) else None
    except Exception:  # a call that never reached the server has none
        return ""
    for key, value in metadata or ():
        if key == REASON_KEY:
            return value if isinstance(value, str) else bytes(value).decode("ascii", "replace")
    return ""
