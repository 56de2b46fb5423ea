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


class NoGroupError(SwarmError, layer.NoGroupError):
    """Fewer than ``min_group_size`` peers were found before the call's timeout."""


class AveragingError(SwarmError):
    """A round failed for another reason than matchmaking (reported by the daemon)."""


class SwarmTimeoutError(SwarmError, TimeoutError):
    """The call did not finish within its timeout."""


class NoStateError(SwarmError, layer.StateNotFoundError):
    """No peer in the run has published state (``load_state``)."""


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
    cls: code for code, cls in _ERROR_FOR_STATUS.items()
}
"""Exception class -> gRPC status code name used by the daemon."""


def error_from_status(code_name: str, details: str | None, endpoint: str) -> SwarmError:
    """Build the exception for a failed control call.

    Args:
        code_name: the gRPC status code's name, e.g. ``"INVALID_ARGUMENT"``.
        details: the daemon's one-line reason (may be empty).
        endpoint: the control endpoint, named in messages about an absent daemon.
    """
    cls = _ERROR_FOR_STATUS.get(code_name, SwarmError)
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
    return error_from_status(name, exc.details(), endpoint)
