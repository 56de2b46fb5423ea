"""Private runs in process: invited ``Peer`` daemons over real gRPC and real TLS.

A peer without a credential of the run (none at all, or one of another run's authority) is
refused at the TLS handshake on every public endpoint: DHT Ping/Store/Find, JoinGroup, Reduce
over gRPC and over the data plane, DownloadState. The same probes against a public peer get
answers, so the refusals are the private run's doing. An invited peer cannot speak as another
invited peer: its requests must name the peer id of its own credential.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import ssl
import struct
import tempfile
from collections.abc import AsyncIterator, Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import numpy as np
import pytest
from google.protobuf.message import Message

from swarmavg.averaging.allreduce.framing import MAGIC
from swarmavg.averaging.allreduce.wire import reduce_digest
from swarmavg.averaging.averager import AveragerConfig
from swarmavg.averaging.stubs import DOWNLOAD_STATE, JOIN_GROUP, REDUCE
from swarmavg.dht import ChannelPool, Identity, RequestSigner
from swarmavg.dht.ranges import split_host
from swarmavg.dht.tls import SERVER_HOSTNAME, PeerTLS
from swarmavg.peer import Peer, PeerConfig
from swarmavg.peer.daemon.config import AllReduceSettings
from swarmavg.proto import averaging_pb2, dht_pb2
from tests.private_runs import Authority, Member

pytestmark = pytest.mark.timeout(90)

RUN = "secret-run"
_HEAD = struct.Struct("<IB")
HELLO, MSG, CLOSE, STATUS = 0, 1, 2, 3
CODES = {code.value[0]: code for code in grpc.StatusCode}
REFUSED = "refused"  # the connection ended before any answer: the handshake failed


@pytest.fixture
def sock_dir() -> Iterator[Path]:
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:
        yield Path(d)


@pytest.fixture
def authority(tmp_path: Path) -> Authority:
    return Authority.create(tmp_path / "run", RUN)


def private_config(
    authority: Authority,
    member: Member,
    sock_dir: Path,
    join: list[str] | None = None,
    client_mode: bool = False,
    data_port: int = 0,
) -> PeerConfig:
    return PeerConfig(
        listen="127.0.0.1:0",
        control=str(sock_dir / f"{member.name}.sock"),
        run_id=authority.run_id,
        join=join or [],
        client_mode=client_mode,
        allreduce=AllReduceSettings(data_port=data_port),
        identity=str(member.identity_path),
        run_file=str(authority.run_path),
        credential=str(member.credential_path),
    )


class ProbedPeerConfig(PeerConfig):
    """A daemon's config whose streams for an unknown group are answered sooner.

    A ``Reduce`` for a group not started here is held ``registration_wait`` (5 s by
    default), in case its round is about to start, before the answer NOT_FOUND: a control
    probe that reaches the handlers waits it out twice (over gRPC and over the data plane).
    The answer is the same after a shorter hold, so the probed daemons hold 1 s.
    """

    def averager_config(self) -> AveragerConfig:
        config = super().averager_config()
        allreduce = dataclasses.replace(config.allreduce, registration_wait=1.0)
        return dataclasses.replace(config, allreduce=allreduce)


def probed(config: PeerConfig) -> PeerConfig:
    """``config`` for a daemon that control probes reach (:class:`ProbedPeerConfig`)."""
    fields = {f.name: getattr(config, f.name) for f in dataclasses.fields(config)}
    return ProbedPeerConfig(**fields)


@dataclass(frozen=True)
class Target:
    address: str
    data_port: int
    peer_id: bytes


def target(peer: Peer) -> Target:
    assert peer.address is not None
    assert peer.averager is not None
    return Target(peer.address, peer.averager.data_port, bytes.fromhex(peer.peer_id))


# ---- the probes: one first message per public endpoint --------------------------------


def signer_of(identity: Identity) -> RequestSigner:
    """Signs as ``identity`` would from client mode (no address of its own)."""
    return RequestSigner(identity, RUN, lambda: "")


def reduce_request(identity: Identity, receiver: bytes) -> bytes:
    """A first ``Reduce`` message signed by ``identity`` for ``receiver`` (a group it has none
    of: a handler that sees it answers NOT_FOUND)."""
    request = averaging_pb2.ReduceRequest(group_id=b"g" * 16)
    digest = reduce_digest(request.group_id, request.part_index, request.weight, 0)
    request.header.CopyFrom(signer_of(identity).sign(receiver, REDUCE, digest))
    return request.SerializeToString()


async def grpc_probes(channels: ChannelPool, peer: Target, identity: Identity) -> dict[str, str]:
    """Each public gRPC method called once by ``identity``, its request signed for ``peer``:
    the status code name, or ``OK`` when it answered."""
    signer = signer_of(identity)
    channel = channels.channel(peer.address)

    def dht(name: str, request: Message) -> bytes:
        return signer.signed(request, peer.peer_id, f"/swarmavg.v1.DHT/{name}").SerializeToString()

    out: dict[str, str] = {}

    async def unary(name: str, request: bytes) -> None:
        try:
            await channel.unary_unary(f"/swarmavg.v1.DHT/{name}")(request, timeout=10)
            out[name] = "OK"
        except grpc.aio.AioRpcError as e:
            out[name] = e.code().name

    async def server_stream(name: str, request: bytes) -> None:
        call = channel.unary_stream(f"/swarmavg.v1.Averaging/{name}")(request, timeout=10)
        try:
            async for _ in call:
                pass
            out[name] = "OK"
        except grpc.aio.AioRpcError as e:
            out[name] = e.code().name

    async def reduce() -> None:
        request = reduce_request(identity, peer.peer_id)
        call = channel.stream_stream("/swarmavg.v1.Averaging/Reduce")(timeout=10)
        try:
            with contextlib.suppress(grpc.aio.AioRpcError, asyncio.InvalidStateError):
                await call.write(request)
                await call.done_writing()
            while await call.read() is not grpc.aio.EOF:
                pass
            out["Reduce"] = "OK"
        except grpc.aio.AioRpcError as e:
            out["Reduce"] = e.code().name

    await unary("Ping", dht("Ping", dht_pb2.PingRequest()))
    await unary("Store", dht("Store", dht_pb2.StoreRequest()))
    await unary("Find", dht("Find", dht_pb2.FindRequest(key_ids=[b"k" * 20])))
    join = signer.signed(averaging_pb2.JoinRequest(), peer.peer_id, JOIN_GROUP)
    await server_stream("JoinGroup", join.SerializeToString())
    state = averaging_pb2.StateRequest(want_manifest=True)
    await server_stream(
        "DownloadState", signer.signed(state, peer.peer_id, DOWNLOAD_STATE).SerializeToString()
    )
    await reduce()
    return out


async def data_plane_probe(peer: Target, context: ssl.SSLContext | None, identity: Identity) -> str:
    """One stream on the data plane, its first message signed for ``peer``: the STATUS
    frame's code name, or :data:`REFUSED`."""
    host, port = split_host(peer.address), peer.data_port
    request = reduce_request(identity, peer.peer_id)
    try:
        async with asyncio.timeout(10):
            if context is None:
                reader, writer = await asyncio.open_connection(host, port)
            else:
                reader, writer = await asyncio.open_connection(
                    host, port, ssl=context, server_hostname=SERVER_HOSTNAME
                )
            try:
                for kind, body in ((HELLO, MAGIC), (MSG, request), (CLOSE, b"")):
                    writer.write(_HEAD.pack(len(body), kind) + body)
                await writer.drain()
                while True:
                    length, kind = _HEAD.unpack(await reader.readexactly(_HEAD.size))
                    body = await reader.readexactly(length)
                    if kind == STATUS:
                        return CODES[body[0]].name
            finally:
                writer.close()
                with contextlib.suppress(OSError, ssl.SSLError):
                    await writer.wait_closed()
    except (OSError, ssl.SSLError, asyncio.IncompleteReadError):
        return REFUSED


async def probe_all(
    peer: Target, channels: ChannelPool, context: ssl.SSLContext | None, identity: Identity
) -> dict[str, str]:
    out = await grpc_probes(channels, peer, identity)
    out["data plane"] = await data_plane_probe(peer, context, identity)
    return out


@contextlib.asynccontextmanager
async def pool(tls: PeerTLS | None) -> AsyncIterator[ChannelPool]:
    channels = ChannelPool(tls=tls)
    try:
        yield channels
    finally:
        await channels.close()


# ---- the tests --------------------------------------------------------------------------


@pytest.mark.parametrize("transport", ["data plane", "grpc"])
async def test_invited_peers_average_through_the_client_api(
    authority: Authority, sock_dir: Path, transport: str
) -> None:
    members = [authority.invite(name) for name in ("a", "b", "c", "d")]
    data_port = 0 if transport == "data plane" else -1  # -1: Reduce over the gRPC port only
    async with Peer(private_config(authority, members[0], sock_dir, data_port=data_port)) as first:
        assert first.address is not None
        async with contextlib.AsyncExitStack() as stack:
            peers = [first]
            for i, member in enumerate(members[1:], 1):
                # The last one behind NAT: it serves nothing, and presents its credential
                # on every connection it opens.
                config = private_config(
                    authority,
                    member,
                    sock_dir,
                    join=[first.address],
                    client_mode=i == 3,
                    data_port=data_port,
                )
                peers.append(await stack.enter_async_context(Peer(config)))
            assert [p.peer_id for p in peers] == [m.identity.peer_id_hex for m in members]
            clients = [await stack.enter_async_context(p.client()) for p in peers]
            rng = np.random.default_rng(3)
            inputs = [rng.standard_normal(200_000).astype(np.float32) for _ in peers]
            calls = [
                c.average([x], key="k", group_size=4, timeout=30)
                for c, x in zip(clients, inputs, strict=True)
            ]
            results = await asyncio.gather(*calls)
            expected = np.mean(inputs, axis=0, dtype=np.float64)
            for result in results:
                assert result.group_size == 4
                assert not result.partial
                np.testing.assert_allclose(result.tensors[0], expected, rtol=1e-5, atol=1e-6)
                assert result.tensors[0].tobytes() == results[0].tensors[0].tobytes()
            assert [bool(p.averager and p.averager.data_port) for p in peers] == [
                transport == "data plane"
            ] * 3 + [False]
            assert peers[3].address is None


@pytest.mark.parametrize("outsider", ["no credential", "another run's credential"])
async def test_a_peer_without_a_credential_of_the_run_is_refused_at_the_first_message(
    authority: Authority, sock_dir: Path, tmp_path: Path, outsider: str
) -> None:
    member = authority.invite("a")
    identity = Identity.generate()
    tls: PeerTLS | None = None
    if outsider == "another run's credential":
        foreign = Authority.create(tmp_path / "foreign", RUN)  # same run name, its own authority
        stranger = foreign.invite("mallory")
        identity, tls = stranger.identity, foreign.tls(stranger)
    public = probed(
        PeerConfig(listen="127.0.0.1:0", control=str(sock_dir / "pub.sock"), run_id=RUN)
    )
    async with (
        Peer(private_config(authority, member, sock_dir)) as private_peer,
        Peer(public) as public_peer,
        pool(tls) as channels,
    ):
        assert private_peer.dht is not None
        received = private_peer.dht.protocol.rpcs_received
        context = tls.client_context if tls is not None else None
        refused = await probe_all(target(private_peer), channels, context, identity)
        assert refused == {
            "Ping": "UNAVAILABLE",
            "Store": "UNAVAILABLE",
            "Find": "UNAVAILABLE",
            "JoinGroup": "UNAVAILABLE",
            "DownloadState": "UNAVAILABLE",
            "Reduce": "UNAVAILABLE",
            "data plane": REFUSED,
        }
        assert private_peer.dht.protocol.rpcs_received == received  # no handler saw them
        if tls is None:
            # The control: the same first messages reach a public peer's handlers.
            answered = await probe_all(target(public_peer), channels, None, identity)
            assert "UNAVAILABLE" not in answered.values(), answered
            assert "UNAUTHENTICATED" not in answered.values(), answered  # signed right
            assert answered["Ping"] == answered["Store"] == answered["Find"] == "OK"
            assert answered["data plane"] != REFUSED


async def test_a_credential_cannot_speak_as_another_peer(
    authority: Authority, sock_dir: Path
) -> None:
    alice, bob, carol = (authority.invite(name) for name in ("alice", "bob", "carol"))
    bob_tls = authority.tls(bob)
    alice_config = probed(private_config(authority, alice, sock_dir))
    async with Peer(alice_config) as peer, pool(bob_tls) as channels:
        where = target(peer)
        # Bob's connection, Carol's header (her public key is no secret): denied everywhere.
        as_carol = await probe_all(where, channels, bob_tls.client_context, carol.identity)
        assert set(as_carol.values()) == {"PERMISSION_DENIED"}, as_carol
        # The control: Bob as himself passes the check (and meets the handlers' own rules).
        as_bob = await probe_all(where, channels, bob_tls.client_context, bob.identity)
        assert "PERMISSION_DENIED" not in as_bob.values(), as_bob
        assert "UNAUTHENTICATED" not in as_bob.values(), as_bob  # signed right
        assert as_bob["Ping"] == "OK"
        assert "UNAVAILABLE" not in as_bob.values()


def test_settings_of_a_private_run(authority: Authority) -> None:
    from swarmavg.peer.daemon.settings import resolve_config

    member = authority.invite("a")
    flags = {
        "run_file": str(authority.run_path),
        "credential": str(member.credential_path),
        "identity": str(member.identity_path),
    }
    # The run file names the run: no --run-id needed.
    assert resolve_config(flags, {}).run_id == RUN
    env = {"SWARMAVG_RUN_FILE": str(authority.run_path)}
    with pytest.raises(ValueError, match="needs both run_file and credential"):
        resolve_config({}, env)
    with pytest.raises(ValueError, match="needs identity"):
        resolve_config({**flags, "identity": None}, {})
    with pytest.raises(ValueError, match="not a swarmavg run file"):
        resolve_config({**flags, "run_file": str(member.credential_path)}, {})
