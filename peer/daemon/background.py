"""A daemon in a background thread of a plain synchronous script.

The counterpart of ``hivemind.DHT(initial_peers=..., start=True)``::

    from swarmavg.peer import start_peer

    with start_peer(run_id="my-run", join=["203.0.113.7:31337"]) as peer:
        print("others join with --join", peer.address)
        with peer.connect() as client:
            ...  # train

The daemon runs on its own event loop in one thread of this process; ``stop()`` (also on
leaving the ``with`` block, including through Ctrl+C's ``KeyboardInterrupt``) runs its one
graceful shutdown and waits for it. Signals stay with the script: the background loop
installs no handler, so a Ctrl+C is one ``KeyboardInterrupt`` in the main thread and one
shutdown, never two signals to a daemon.
"""

from __future__ import annotations

import asyncio
import threading
from collections.abc import Sequence
from types import TracebackType
from typing import TYPE_CHECKING, Any

from swarmavg.averaging.signal_mask import leave_signals_to_main_thread
from swarmavg.peer.client.client import Client, connect
from swarmavg.peer.daemon.config import PeerConfig

if TYPE_CHECKING:
    from swarmavg.peer.daemon.daemon import Peer

START_TIMEOUT = 120.0
"""Seconds ``start_peer`` waits for the daemon to be ready (bootstrap included)."""


class BackgroundPeer:
    """A :class:`~swarmavg.peer.daemon.daemon.Peer` running on a background thread's event loop.

    ``start()`` once (``start_peer`` does it), ``stop()`` is idempotent. The attributes
    ``peer_id``, ``address`` (None in client mode), ``control`` and ``ready`` (the fields of
    the CLI's JSON ready line) are set once started.
    """

    def __init__(self, config: PeerConfig) -> None:
        self.config = config
        self.ready: dict[str, Any] = {}
        self.peer: Peer | None = None
        """The daemon itself (for benchmarks and tests; its loop is the background thread's)."""
        self._thread: threading.Thread | None = None
        self._started = threading.Event()
        self._error: BaseException | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._stop: asyncio.Event | None = None
        self._stopped = False

    @property
    def peer_id(self) -> str:
        return str(self.ready["peer_id"])

    @property
    def address(self) -> str | None:
        address = self.ready.get("address")
        return str(address) if address else None

    @property
    def control(self) -> str:
        return str(self.ready["control"])

    def start(self, timeout: float = START_TIMEOUT) -> BackgroundPeer:
        """Start the daemon and wait until it is ready.

        Raises:
            StartupError: the daemon cannot start (port taken, no initial peer answered,
                ...); the message is the one ``swarmavg peer`` prints.
            TimeoutError: not ready within ``timeout`` seconds (it is then stopped).
            RuntimeError: started twice.
        """
        if self._thread is not None:
            raise RuntimeError("BackgroundPeer.start() may be called once")
        self._thread = threading.Thread(target=self._run, name="swarmavg-peer", daemon=True)
        self._thread.start()
        if not self._started.wait(timeout):
            self.stop()
            raise TimeoutError(f"the swarmavg daemon was not ready within {timeout:.0f} s")
        if self._error is not None:
            self._thread.join()
            raise self._error
        return self

    def connect(self, *, use_shm: bool = True) -> Client:
        """A blocking client of this daemon (``with peer.connect() as client:``)."""
        return connect(self.control, use_shm=use_shm)

    def stop(self, timeout: float = 30.0) -> None:
        """Shut the daemon down gracefully (``shutdown_grace`` for rounds in flight) and wait
        for its thread; idempotent."""
        if self._stopped or self._thread is None:
            return
        self._stopped = True
        loop, stop = self._loop, self._stop
        if loop is not None and stop is not None and not loop.is_closed():
            loop.call_soon_threadsafe(stop.set)
        self._thread.join(timeout)

    def _run(self) -> None:
        # Taken by this thread (or by gRPC's, which inherit its mask), a Ctrl+C would only
        # set Python's flag, and a main thread blocked in a wait (``Event().wait()``) would
        # never raise KeyboardInterrupt: 1 in 20-40 Ctrl+Cs under load did nothing.
        leave_signals_to_main_thread()
        asyncio.run(self._main())

    async def _main(self) -> None:
        from swarmavg.peer.daemon.daemon import Peer

        self._loop = asyncio.get_running_loop()
        self._stop = asyncio.Event()
        peer = self.peer = Peer(self.config)
        try:
            await peer.start()
        except BaseException as exc:  # handed to the caller's thread by start()
            self._error = exc
            self._started.set()
            return
        self.ready = peer.ready_record()
        self._started.set()
        try:
            await self._stop.wait()
        finally:
            await peer.shutdown()

    def __enter__(self) -> BackgroundPeer:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


def start_peer(
    config: PeerConfig | None = None,
    *,
    run_id: str | None = None,
    join: Sequence[str] = (),
    listen: str | None = None,
    announce: str | None = None,
    client_mode: bool = False,
    control: str | None = None,
    timeout: float = START_TIMEOUT,
) -> BackgroundPeer:
    """Start a daemon in a background thread of this process; return it once ready.

    Args:
        config: every setting (docs/peer.md); the keywords below build one when it is None
            (they cannot be combined with it).
        run_id: the run (default ``"default"``).
        join: initial peers, ``HOST:PORT``; none founds a new swarm.
        listen: public address to bind (default ``0.0.0.0:31337``; port 0 picks a free one).
        announce: the address others dial, when it differs from the bound one.
        client_mode: accept no incoming connections (behind NAT).
        control: the control endpoint (default: the run's socket).
        timeout: seconds to wait for the daemon to be ready.

    Raises:
        ValueError: a bad setting, or ``config`` together with keywords.
        StartupError: the daemon cannot start (the CLI's one-line message).
        TimeoutError: not ready within ``timeout``.
    """
    if config is not None:
        if any(v is not None for v in (run_id, listen, announce, control)) or join or client_mode:
            raise ValueError("pass either config or keyword settings to start_peer, not both")
    else:
        defaults = PeerConfig()
        config = PeerConfig(
            run_id=run_id or defaults.run_id,
            join=list(join),
            listen=listen or defaults.listen,
            announce=announce,
            client_mode=client_mode,
            control=control,
        )
    return BackgroundPeer(config).start(timeout)
