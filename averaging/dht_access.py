"""What the averaging layer needs of the DHT, as a protocol (``swarmavg.dht.DHTNode`` fits).

Matchmaking and state sharing only store and read dictionary records, sign their requests
and authenticate other peers' requests; typing them against this protocol keeps the dependency
narrow.
"""

from __future__ import annotations

from typing import Any, Protocol

from swarmavg.dht.auth import Authenticator, RequestSigner


class DHTAccess(Protocol):
    """The part of :class:`swarmavg.dht.DHTNode` that matchmaking and state sharing use."""

    @property
    def peer_id(self) -> bytes: ...

    async def store(
        self,
        key: str,
        value: Any,
        expiration: float,
        subkey: Any = None,
        replicas: int | None = None,
    ) -> bool: ...

    async def get(self, key: str, latest: bool = False, quorum: int | None = None) -> Any: ...

    async def store_and_get(
        self,
        key: str,
        value: Any,
        expiration: float,
        subkey: Any = None,
        replicas: int | None = None,
    ) -> tuple[bool, Any]: ...

    @property
    def signer(self) -> RequestSigner: ...

    @property
    def authenticator(self) -> Authenticator: ...


def dictionary_entries(record: Any) -> dict[Any, Any]:
    """``{subkey: value}`` of a DHT dictionary record (``get``'s result), dropping wrappers."""
    if record is None:
        return {}
    value = getattr(record, "value", record)
    if not isinstance(value, dict):
        return {}
    return {k: getattr(v, "value", v) for k, v in value.items()}
