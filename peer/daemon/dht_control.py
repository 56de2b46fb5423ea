"""The control endpoint of a bare DHT node (``swarmavg dht --control ENDPOINT``).

It answers what makes sense for a node without an averager: ``Status`` (its id, address,
routing table, stored records; ``swarmavg status``), ``Peers`` (the run's view through its
DHT; ``swarmavg peers``) and the DHT calls (a script can read and write records through
it), exactly as a peer daemon's control service does. Averaging and state sharing are
answered UNIMPLEMENTED with what to use instead.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import grpc

from swarmavg.peer.daemon.control import ControlService
from swarmavg.proto import control_pb2

NOT_A_PEER = (
    "this is a bare DHT node (swarmavg dht): it does not average or share state; "
    "connect the training process to a `swarmavg peer` daemon"
)


class DHTControlService(ControlService):
    """A peer's control service without the calls a bare DHT node cannot serve.

    ``backend`` needs ``status()``, ``peers(training_run)``, ``dht_get(key)`` and
    ``dht_store(key, value, ttl, subkey)`` (``swarmavg.peer.daemon.bare_dht.BareDHT``).
    """

    async def Average(
        self, requests: AsyncIterator[control_pb2.AverageRequest], context: Any
    ) -> AsyncIterator[control_pb2.AverageResponse]:
        await _not_a_peer(context)
        yield control_pb2.AverageResponse()  # pragma: no cover - abort raised

    async def PublishState(
        self, requests: AsyncIterator[control_pb2.StateMessage], context: Any
    ) -> control_pb2.PublishStateResponse:
        await _not_a_peer(context)
        return control_pb2.PublishStateResponse()  # pragma: no cover - abort raised

    async def LoadState(
        self, request: control_pb2.LoadStateRequest, context: Any
    ) -> AsyncIterator[control_pb2.StateMessage]:
        await _not_a_peer(context)
        yield control_pb2.StateMessage()  # pragma: no cover - abort raised


async def _not_a_peer(context: grpc.aio.ServicerContext[Any, Any]) -> None:
    """Answer UNIMPLEMENTED (``abort`` raises, ending the call)."""
    await context.abort(grpc.StatusCode.UNIMPLEMENTED, NOT_A_PEER)
