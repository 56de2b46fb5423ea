"""gRPC status codes <-> SwarmError classes, both directions."""

from __future__ import annotations

import grpc
import pytest

from swarmavg.averaging import errors as averaging_errors
from swarmavg.peer.client import errors
from swarmavg.peer.daemon.control import classify


@pytest.mark.parametrize(
    ("exc", "expected"),
    [
        (errors.ValidationError("x"), errors.ValidationError),
        (averaging_errors.SchemaMismatchError("x"), errors.ValidationError),
        (averaging_errors.InvalidTensorsError("x"), errors.ValidationError),
        (ValueError("unknown codec"), errors.ValidationError),
        (averaging_errors.NoGroupError("x"), errors.NoGroupError),
        (averaging_errors.StateNotFoundError("x"), errors.NoStateError),
        (averaging_errors.AveragingError("x"), errors.AveragingError),
        (TimeoutError("x"), errors.SwarmTimeoutError),
        (errors.DaemonUnavailableError("x"), errors.DaemonUnavailableError),
        (RuntimeError("x"), errors.SwarmError),
    ],
)
def test_daemon_side_errors_map_to_client_classes(
    exc: Exception, expected: type[errors.SwarmError]
) -> None:
    code, _ = classify(exc)
    mapped = errors.error_from_status(code.name, "why", "/tmp/x.sock")
    assert type(mapped) is expected
    assert isinstance(mapped, errors.SwarmError)


def test_unavailable_without_details_names_the_endpoint() -> None:
    mapped = errors.error_from_status(grpc.StatusCode.UNAVAILABLE.name, "", "/tmp/x.sock")
    assert "/tmp/x.sock" in str(mapped)
    assert "swarmavg peer" in str(mapped)


@pytest.mark.parametrize(
    ("refined", "client_class", "plain", "sibling"),
    [
        (
            averaging_errors.SchemaMismatchError("x"),
            errors.SchemaMismatchError,
            errors.ValidationError,
            averaging_errors.InvalidTensorsError("nan"),
        ),
        (
            averaging_errors.RoundClosedError("x"),
            errors.RoundClosedError,
            errors.NoGroupError,
            averaging_errors.NoGroupError("nobody came"),
        ),
    ],
)
def test_the_reason_label_tells_a_refined_failure_from_its_plain_class(
    refined: Exception,
    client_class: type[errors.SwarmError],
    plain: type[errors.SwarmError],
    sibling: Exception,
) -> None:
    code, reason = classify(refined)
    mapped = errors.error_from_status(code.name, "why", "/tmp/x.sock", reason)
    assert type(mapped) is client_class
    assert isinstance(mapped, plain)  # what callers caught before
    assert isinstance(mapped, type(refined))
    # without the label (an older daemon), or with another one: the plain class
    assert type(errors.error_from_status(code.name, "why", "x", "")) is plain
    code, reason = classify(sibling)
    assert type(errors.error_from_status(code.name, "why", "x", reason)) is plain
