"""The client's halves of a call: the daemon's result reaches the caller whole."""

from __future__ import annotations

import numpy as np

from swarmavg.averaging.request import STATE_DIGEST_TAG
from swarmavg.averaging.result import AveragingResult
from swarmavg.peer.client.calls import PreparedAverage
from swarmavg.peer.client.tensors import iter_bytes
from swarmavg.peer.daemon.control import _done_message
from swarmavg.proto import control_pb2


def _daemon_result(tensors: list[np.ndarray]) -> AveragingResult:
    """A daemon's record whose every field differs from its default."""
    return AveragingResult(
        tensors=tensors,
        group_size=3,
        peers=["aa", "bb", "cc"],
        group_id="0f",
        codec="uint8-blockwise",
        partial=True,
        timings={"matchmaking": 0.5, "allreduce": 0.25},
        bytes_sent=1234,
        bytes_received=5678,
        gathered={"aa": STATE_DIGEST_TAG + b"d" * 32, "bb": b"opaque"},
        local_callers=2,
        aggregation="trimmed-mean",
        num_adjusted=7,
        weights_clipped=1,
        local_fraction=0.125,
    )


def test_client_result_keeps_every_field_the_daemon_sends() -> None:
    # Every field of AverageDone that the daemon fills must come out of the client's
    # result with the daemon's value: a field added to the message but not to the
    # client's record (or copied by hand and forgotten) fails here.
    inputs = [np.arange(4, dtype=np.float32)]
    call = PreparedAverage(
        inputs,
        key="k",
        weight=1.0,
        group_size=None,
        min_group_size=2,
        timeout=5.0,
        codec=None,
        segments=None,
    )
    daemon = _daemon_result([inputs[0] * 2])
    call.feed(control_pb2.AverageResponse(accepted=control_pb2.AverageAccepted()))
    for piece in iter_bytes(daemon.tensors):
        call.feed(control_pb2.AverageResponse(data=piece))
    call.feed(control_pb2.AverageResponse(done=_done_message(daemon)))
    client = call.result()

    np.testing.assert_array_equal(client.tensors[0], daemon.tensors[0])
    names = set(control_pb2.AverageDone.DESCRIPTOR.fields_by_name)
    for name in sorted(names - {"timings"}):
        assert getattr(client, name) == getattr(daemon, name), name
    assert client.state_digests == {"aa": b"d" * 32}
    # The daemon's phases, and the client's own beside them.
    assert client.timings.items() >= daemon.timings.items()
    assert {"client.prepare", "client.call"} <= set(client.timings)
