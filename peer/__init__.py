"""The swarmavg peer: the client library, the daemon with its control service, the monitor,
the CLI and NAT traversal, each a subpackage (docs/architecture.md).

Public API (docs/peer.md)::

    from swarmavg.peer import connect, connect_async, Peer, PeerConfig
    from swarmavg.peer import SwarmError, NoGroupError, DaemonUnavailableError, ValidationError
    from swarmavg.peer import enable_logging   # the library's log lines in a training script
    from swarmavg.peer import start_peer       # a daemon in a background thread (context manager)

``Peer``, ``PeerConfig`` and ``start_peer`` are imported lazily: a training process that only
uses the client never loads the daemon's DHT and averaging modules (tests/test_layout.py
checks the import closure). ``__version__`` is read on first use (peer/version.py).
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from swarmavg.peer.client.calls import AverageResult
from swarmavg.peer.client.client import AsyncClient, Client, connect, connect_async
from swarmavg.peer.client.errors import (
    AveragingError,
    DaemonUnavailableError,
    NoGroupError,
    NoStateError,
    RoundClosedError,
    SchemaMismatchError,
    SwarmError,
    SwarmTimeoutError,
    ValidationError,
)
from swarmavg.peer.logs import enable_logging

if TYPE_CHECKING:
    from swarmavg.peer.daemon.background import BackgroundPeer, start_peer
    from swarmavg.peer.daemon.config import PeerConfig
    from swarmavg.peer.daemon.daemon import Peer

    __version__: str


def __getattr__(name: str) -> Any:
    if name == "__version__":  # read on first use: see peer/version.py
        from swarmavg.peer.version import installed_version

        return installed_version()
    if name == "Peer":
        from swarmavg.peer.daemon.daemon import Peer

        return Peer
    if name == "PeerConfig":  # the daemon's whole config tree: the client never needs it
        from swarmavg.peer.daemon.config import PeerConfig

        return PeerConfig
    if name in ("start_peer", "BackgroundPeer"):
        from swarmavg.peer.daemon import background

        return getattr(background, name)
    raise AttributeError(f"module 'swarmavg.peer' has no attribute {name!r}")


__all__ = [
    "AsyncClient",
    "AverageResult",
    "AveragingError",
    "BackgroundPeer",
    "Client",
    "DaemonUnavailableError",
    "NoGroupError",
    "NoStateError",
    "Peer",
    "PeerConfig",
    "RoundClosedError",
    "SchemaMismatchError",
    "SwarmError",
    "SwarmTimeoutError",
    "ValidationError",
    "__version__",
    "connect",
    "connect_async",
    "enable_logging",
    "start_peer",
]
