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


def test_the_reason_label_tells_a_schema_mismatch_from_bad_input() -> None:
    code, reason = classify(averaging_errors.SchemaMismatchError("x"))
    mapped = errors.error_from_status(code.name, "why", "/tmp/x.sock", reason)
    assert type(mapped) is errors.SchemaMismatchError
    assert isinstance(mapped, errors.ValidationError)  # what callers caught before
    assert isinstance(mapped, averaging_errors.SchemaMismatchError)
    # without the label (an older daemon), or with another one: the plain class
    assert type(errors.error_from_status(code.name, "why", "x", "")) is errors.ValidationError
    code, reason = classify(averaging_errors.InvalidTensorsError("nan"))
    assert type(errors.error_from_status(code.name, "why", "x", reason)) is errors.ValidationError
