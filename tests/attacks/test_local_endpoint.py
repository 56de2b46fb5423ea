"""What another local user can get at on the daemon's machine.

* **The TCP control endpoint.** A client of ``127.0.0.1:PORT`` read the daemon's token file
  and sent the token, then its tensors, to whatever listened on the port. A port has no
  owner to check: when the daemon exits (here: killed, so its token file stays), anyone may
  listen there next, and the next client hands it the token and its tensors. The client
  must authenticate the daemon before it sends anything.
* **The identity key file.** An existing key file was loaded whatever its mode, so a key that
  other users can read (a copied file, a umask 022 ``cp``) went unnoticed: whoever reads it
  is that peer. As ssh does with a private key, such a file is refused, with the ``chmod``
  that fixes it.

Real daemons on 127.0.0.1 (one in its own process, so that it can die as a crashed daemon
does), with a control run each: the client is served by its live daemon, and a private key
file loads.
"""

from __future__ import annotations

import asyncio
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest

from swarmavg.dht import Identity
from swarmavg.peer import DaemonUnavailableError, Peer, PeerConfig, connect, connect_async
from swarmavg.peer.client.control_access import token_path
from swarmavg.peer.client.endpoint import ControlEndpoint
from swarmavg.peer.client.errors import SwarmError
from swarmavg.peer.daemon.daemon import StartupError
from tests.attacks.local_scenarios import impostor_on, tcp_daemon

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def runtime_dir(monkeypatch: pytest.MonkeyPatch) -> Iterator[Path]:
    """A private XDG_RUNTIME_DIR (the daemon's token folder), inherited by subprocesses."""
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa40-") as d:
        folder = Path(d) / "runtime"
        folder.mkdir(mode=0o700)
        monkeypatch.setenv("XDG_RUNTIME_DIR", str(folder))
        yield folder


async def test_a_client_sends_nothing_to_a_listener_that_took_a_dead_daemons_port(
    runtime_dir: Path, tmp_path: Path
) -> None:
    async with tcp_daemon(tmp_path / "daemon.log") as (daemon, port):
        endpoint = f"127.0.0.1:{port}"
        token_file = token_path(ControlEndpoint(host="127.0.0.1", port=port))

        # control: the daemon's user is served by the live daemon
        async with await connect_async(endpoint) as client:
            result = await client.average(
                [np.ones(8, np.float32)], key="k", min_group_size=1, timeout=30
            )
            np.testing.assert_array_equal(result.tensors[0], np.ones(8, np.float32))

        # the daemon dies without cleaning up; another program listens on its port
        daemon.kill()
        await daemon.wait()
        assert token_file.exists()
        async with impostor_on(endpoint) as impostor:
            # honest outcome: both clients refuse to connect, and the listener got nothing
            async def connect_asyncio() -> None:
                async with await connect_async(endpoint, connect_timeout=10) as client:
                    await client.average([np.ones(8, np.float32)], key="k", timeout=10)

            def connect_blocking() -> None:
                with connect(endpoint, connect_timeout=10) as sync_client:
                    sync_client.average([np.ones(8, np.float32)], key="k", timeout=10)

            outcomes: list[SwarmError | None] = []
            for attempt in (connect_asyncio(), asyncio.to_thread(connect_blocking)):
                try:
                    await attempt
                    outcomes.append(None)
                except SwarmError as e:
                    outcomes.append(e)
            assert impostor.calls == [], "the clients sent the impostor their calls and token"
            assert all(isinstance(o, DaemonUnavailableError) for o in outcomes), outcomes


@pytest.mark.parametrize("mode", [0o644, 0o640, 0o604, 0o660], ids=lambda m: f"{m:o}")
async def test_an_identity_file_other_users_may_read_is_refused(
    runtime_dir: Path, tmp_path: Path, mode: int
) -> None:
    path = tmp_path / "identity.key"
    identity = Identity.load_or_create(path)
    config = PeerConfig(listen="127.0.0.1:0", identity=str(path), run_id="t40k")
    # control: a private key file loads, as the same peer
    async with Peer(config) as peer:
        assert peer.peer_id == identity.peer_id_hex

    os.chmod(path, mode)
    with pytest.raises(PermissionError, match="chmod 600"):
        Identity.load_or_create(path)
    with pytest.raises(StartupError, match="chmod 600"):
        async with Peer(config):
            pass
    assert path.stat().st_mode & 0o777 == mode, "the file is left as it was"
