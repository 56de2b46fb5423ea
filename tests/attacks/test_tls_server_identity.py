"""A private-run member on the path answers in another member's place (medium).

Every credential of a run carried the same DNS name and clients checked only that name:
the handshake proved that the server was *a* member of the run, never *which*. A member on
the path to another (a relay it runs, an address it took over) could therefore serve the
gRPC calls and the data-plane streams meant for that other member: take a reducer's part,
answer a JoinGroup as the leader, serve a state download.

Now every credential also names its own peer (``<hex id>.peer.swarmavg.invalid``,
dht/credentials.py) and a client that knows whom it dials checks that name (gRPC channels,
dht/channels.py) or the peer id in the certificate (the data plane, before its HELLO).

Here the impostor M serves with its own valid credential of the run; the client B dials it
believing it is A. The control dials M as M.
"""

from __future__ import annotations

from pathlib import Path

import grpc
import pytest

from swarmavg.averaging.allreduce.data_connector import DataConnector
from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.dht import ChannelPool
from swarmavg.dht.auth import Authenticator
from swarmavg.dht.server_limits import ServerLimits
from swarmavg.dht.tls import PeerTLS, bind_port, new_server
from swarmavg.proto import common_pb2
from tests.private_runs import Authority

pytestmark = pytest.mark.timeout(60)

RUN = "secret-run"
ECHO = "/swarmavg.test.Echo/Echo"


def echo_request(sender: bytes) -> bytes:
    """A request whose header (field 1) names ``sender``, as the server's binding check
    wants."""
    header = common_pb2.RequestHeader(peer_id=sender).SerializeToString()
    return b"\x0a" + bytes([len(header)]) + header


async def echo_server(tls: PeerTLS) -> tuple[grpc.aio.Server, str]:
    """A private-run gRPC server (the run's mutual TLS and peer binding) with one echo."""

    async def echo(request: bytes, context: grpc.aio.ServicerContext[bytes, bytes]) -> bytes:
        return request

    server = new_server(ServerLimits(), tls)
    handler = grpc.unary_unary_rpc_method_handler(echo)
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("swarmavg.test.Echo", {"Echo": handler}),)
    )
    port = bind_port(server, "127.0.0.1:0", tls)
    await server.start()
    return server, f"127.0.0.1:{port}"


async def test_a_grpc_channel_to_one_member_refuses_another_members_server(
    tmp_path: Path,
) -> None:
    authority = Authority.create(tmp_path / "run", RUN)
    a, b, m = (authority.invite(name) for name in ("a", "b", "m"))
    server, address = await echo_server(authority.tls(m))
    pool = ChannelPool(tls=authority.tls(b))
    request = echo_request(b.identity.peer_id)
    try:
        # Control: B dials M knowing it is M.
        answer = await pool.channel(address, m.identity.peer_id).unary_unary(ECHO)(
            request, timeout=10
        )
        assert answer == request
        # Attack: B dials A's address, where M answers with its own valid credential.
        with pytest.raises(grpc.aio.AioRpcError) as refused:
            await pool.channel(address, a.identity.peer_id).unary_unary(ECHO)(request, timeout=10)
        assert refused.value.code() is grpc.StatusCode.UNAVAILABLE
    finally:
        await pool.close()
        await server.stop(None)


async def test_a_data_plane_stream_to_one_member_refuses_another_members_server(
    tmp_path: Path,
) -> None:
    authority = Authority.create(tmp_path / "run", RUN)
    a, b, m = (authority.invite(name) for name in ("a", "b", "m"))
    tls_m = authority.tls(m)
    impostor = AllReduceService(Authenticator(m.identity, RUN), tls=tls_m)
    port = await impostor.start_data_plane("127.0.0.1")
    assert port
    connector = DataConnector(tls=authority.tls(b))
    try:
        # Control: a stream to M as M opens (HELLO exchanged).
        call = await connector.open("127.0.0.1", port, 10.0, peer_id=m.identity.peer_id)
        assert call is not None
        call.cancel()
        # Attack: a stream meant for A is not opened on M's server; nothing was sent.
        fresh = DataConnector(tls=authority.tls(b))
        try:
            assert await fresh.open("127.0.0.1", port, 10.0, peer_id=a.identity.peer_id) is None
            assert fresh.opened == 0
        finally:
            fresh.close()
        # Nor does the connector that reached M as M open one there for A.
        assert await connector.open("127.0.0.1", port, 10.0, peer_id=a.identity.peer_id) is None
    finally:
        connector.close()
        await impostor.close()
