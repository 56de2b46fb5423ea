"""Contacts are learned only from their owners; one address range cannot fill a bucket.

The routing hijack: a node answers a lookup with ``(victim id, attacker
address)`` and then answers, at that address, with the victim's public key copied into its
header (a real signed header of the victim, replayed, with its real address binding). The
attacker's own node is an honest, correctly signing peer. The querier must keep the victim's
real address, and the fake address must never enter its table: the attacker can sign neither
an answer as the victim nor the victim's binding of its own address.
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message

from swarmavg.dht import DHTConfig, DHTNode, Identity
from swarmavg.dht.auth import AuthenticationError, RequestSigner, message_digest, sign_request
from swarmavg.dht.identity import HeaderError, address_signature_payload
from swarmavg.dht.ranges import address_range, grpc_peer_host, limited_range
from swarmavg.dht.routing import Contact, RoutingTable
from swarmavg.dht.traversal import traverse
from swarmavg.proto import common_pb2, dht_pb2

pytestmark = pytest.mark.timeout(60)

Answer = Callable[[str, bytes], bytes]  # (method, request bytes) -> answer bytes
REQUESTS: dict[str, type[Message]] = {
    "Ping": dht_pb2.PingRequest,
    "Store": dht_pb2.StoreRequest,
    "Find": dht_pb2.FindRequest,
}


@asynccontextmanager
async def fake_dht(answer: Answer, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """A hand-written DHT service on a real port; yields its HOST:PORT."""

    def handler(method: str) -> grpc.RpcMethodHandler:
        async def behavior(request: bytes, context: object) -> bytes:
            return answer(method, request)

        return grpc.unary_unary_rpc_method_handler(behavior)

    server = grpc.aio.server()
    methods = {m: handler(m) for m in REQUESTS}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("swarmavg.v1.DHT", methods),)
    )
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    try:
        yield f"{host}:{port}"
    finally:
        await server.stop(None)


def _full(method: str) -> str:
    return f"/swarmavg.v1.DHT/{method}"


def _distance(a: bytes, b: bytes) -> int:
    return int.from_bytes(a, "big") ^ int.from_bytes(b, "big")


def _closed_address() -> str:
    """A loopback address where nothing listens (a port the OS gave us, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def binding(identity: Identity, address: str) -> bytes:
    return identity.sign(address_signature_payload("test", identity.peer_id, address))


def request_header(method: str, request: bytes) -> common_pb2.RequestHeader:
    return REQUESTS[method].FromString(request).header  # type: ignore[attr-defined,no-any-return]


def answer_body(method: str, request: bytes, named: list[Contact]) -> Message:
    """A well-formed answer, without header or binding; a Find names ``named`` as the nearest
    peers to every id."""
    if method == "Ping":
        return dht_pb2.PingResponse()
    if method == "Store":
        store = dht_pb2.StoreRequest.FromString(request)
        return dht_pb2.StoreResponse(statuses=[dht_pb2.STORE_STATUS_STORED] * len(store.records))
    find = dht_pb2.FindRequest.FromString(request)
    response = dht_pb2.FindResponse()
    for _ in find.key_ids:
        result = response.results.add()
        for c in named:
            result.nearest.add(peer_id=c.peer_id, address=c.address)
    response.store_statuses.extend([dht_pb2.STORE_STATUS_STORED] * len(find.store))
    return response


def honest_answer(
    identity: Identity, address: str, method: str, request: bytes, named: list[Contact]
) -> bytes:
    """The answer an honest peer at ``address`` gives: its binding of that address, and a
    header signed for the requester, bound to the request's nonce (as protocol._answer)."""
    asked = request_header(method, request)
    answer = answer_body(method, request, named)
    answer.address_signature = binding(identity, address)  # type: ignore[attr-defined]
    digest = message_digest(answer, bound_to=asked.nonce)
    header = sign_request(
        identity, "test", address, bytes(asked.peer_id), _full(method), digest, response=True
    )
    answer.header.CopyFrom(header)  # type: ignore[attr-defined]
    return answer.SerializeToString()


@pytest.mark.parametrize("victim_known", [True, False])
@pytest.mark.parametrize("claimed", ["attacker", "victim"])
async def test_routing_hijack_keeps_the_victims_address(victim_known: bool, claimed: str) -> None:
    """A lookup answered with (victim id, attacker address): the fake contact never enters."""
    querier = await DHTNode.create(DHTConfig(run_id="test"))
    assert querier.address is not None
    victim = await DHTNode.create(
        DHTConfig(run_id="test", initial_peers=[querier.address] if victim_known else [])
    )
    assert victim.address is not None
    assert (victim.peer_id in querier.routing) == victim_known
    front = Identity.generate()  # the attacker's own node: an honest, correctly signing peer
    posing: dict[str, str] = {}  # the addresses of the attacker's two servers
    replayed: dict[str, common_pb2.RequestHeader | bytes] = {}  # captured from the victim
    dialled: list[str] = []  # methods asked at the address that answers as the victim

    def as_victim(method: str, request: bytes) -> bytes:
        # The victim's real signed header and its real address binding, replayed from one of
        # its answers, readdressed to the requester and this method; the header claims either
        # the attacker's address or the victim's. The attacker cannot sign it as the victim.
        dialled.append(method)
        header = common_pb2.RequestHeader()
        header.CopyFrom(replayed["header"])  # type: ignore[arg-type]
        header.receiver_id = request_header(method, request).peer_id
        header.method = _full(method)
        if claimed == "attacker":
            header.address = posing["address"]
        answer = answer_body(method, request, [])
        answer.header.CopyFrom(header)  # type: ignore[attr-defined]
        answer.address_signature = replayed["binding"]  # type: ignore[attr-defined]
        return answer.SerializeToString()

    # Refused answers, seen where the querier checks them.
    refused: list[HeaderError] = []
    check_response = querier.protocol.authenticator.check_response

    def spy(*args: Any, **kwargs: Any) -> bytes:
        try:
            return check_response(*args, **kwargs)
        except HeaderError as e:
            refused.append(e)
            raise

    querier.protocol.authenticator.check_response = spy  # type: ignore[method-assign]

    try:
        async with fake_dht(as_victim) as fake_address:
            posing["address"] = fake_address
            hearsay = [Contact(victim.peer_id, fake_address)]

            def as_front(method: str, request: bytes) -> bytes:
                return honest_answer(front, posing["front"], method, request, hearsay)

            async with fake_dht(as_front) as front_address:
                posing["front"] = front_address
                signer = RequestSigner(front, "test", lambda: front_address)
                own_binding = binding(front, front_address)
                # the attacker records a real answer of the victim (to a ping of its own)
                channel = grpc.aio.insecure_channel(victim.address)
                ping = signer.signed(
                    dht_pb2.PingRequest(address_signature=own_binding),
                    victim.peer_id,
                    _full("Ping"),
                )
                pong = dht_pb2.PingResponse.FromString(
                    await channel.unary_unary(_full("Ping"))(ping.SerializeToString(), timeout=5)
                )
                await channel.close()
                assert pong.header.peer_id == victim.peer_id
                assert pong.header.signature
                replayed["header"] = pong.header
                replayed["binding"] = pong.address_signature
                # the front makes itself known to the querier with a valid, own signed request
                channel = grpc.aio.insecure_channel(querier.address)
                ping = signer.signed(
                    dht_pb2.PingRequest(address_signature=own_binding),
                    querier.peer_id,
                    _full("Ping"),
                )
                await channel.unary_unary(_full("Ping"))(ping.SerializeToString(), timeout=5)
                await channel.close()
                assert front.peer_id in querier.routing
                # a lookup of the front's id with k=2 asks the front and a dead contact nearer
                # to it than the victim; once the dead one fails, the victim (as the front
                # names it, at the attacker's address) is among the 2 nearest and is dialled
                dead = Identity.generate().peer_id
                while (dead_d := _distance(dead, front.peer_id)) > _distance(
                    victim.peer_id, front.peer_id
                ):
                    dead = Identity.generate().peer_id
                assert dead_d >= 0
                querier.routing.add_or_update(Contact(dead, _closed_address()))
                lookups = await traverse(querier.protocol, [front.peer_id], want_values=False, k=2)
                assert lookups[front.peer_id].nearest
        # the front's own answers were accepted: it is an honest peer at its own address
        known_front = querier.routing.get(front.peer_id)
        assert known_front is not None
        assert known_front.address == front_address
        known = querier.routing.get(victim.peer_id)
        if victim_known:
            assert known is not None
            assert known.address == victim.address
        else:
            assert known is None
        assert all(c.address != fake_address for c in querier.routing)
        # a known victim is dialled at its known address; an unknown one at the named address,
        # whose answer cannot carry the victim's signature and is refused
        assert bool(dialled) != victim_known
        assert bool(refused) != victim_known
        assert all(isinstance(e, AuthenticationError) for e in refused)
        assert all("signature does not verify" in str(e) for e in refused)
        assert all(c.address != fake_address for c in lookups[front.peer_id].nearest)
        # the real victim is still reachable under its id, and the querier learns it then
        pinged = await querier.protocol.call_ping(victim.address, expected_id=victim.peer_id)
        assert pinged.peer_id == victim.peer_id
        known = querier.routing.get(victim.peer_id)
        assert known is not None
        assert known.address == victim.address
    finally:
        await victim.shutdown()
        await querier.shutdown()


async def test_an_initial_peer_written_as_a_name_is_followed_to_its_bound_address() -> None:
    """An answer bound to another address than the one dialled is a hint, not a contact."""
    first = await DHTNode.create(DHTConfig(run_id="test"))
    assert first.address is not None
    port = first.address.rpartition(":")[2]
    second = await DHTNode.create(DHTConfig(run_id="test", initial_peers=[f"localhost:{port}"]))
    try:
        known = second.routing.get(first.peer_id)
        assert known is not None
        assert known.address == first.address
        assert all(not c.address.startswith("localhost") for c in second.routing)
    finally:
        await second.shutdown()
        await first.shutdown()


def test_ranges() -> None:
    assert address_range("1.2.3.4:5") == ("1.2.3.0/24", False)
    assert address_range("[2001:db8:1:2::1]:5")[0] == "2001:db8:1::/48"
    assert address_range("127.9.9.9:1") == ("127.9.9.0/24", True)
    assert address_range("10.1.2.3:1")[1]
    assert address_range("localhost:1")[1]
    # every DNS name shares one range: a name says nothing of the network behind it
    assert address_range("Example.org:1") == ("dns-names", False)
    assert address_range("other.example:1") == address_range("example.org:2")
    assert address_range("a.localhost:1") == ("localhost", True)
    assert limited_range("127.0.0.1", False) is None
    assert limited_range("127.0.0.1", True) == "127.0.0.0/24"
    assert grpc_peer_host("ipv4:1.2.3.4:5") == "1.2.3.4"
    assert grpc_peer_host("ipv6:%5B::1%5D:5") == "::1"
    assert grpc_peer_host("unix:/tmp/x") == ""


def test_one_range_cannot_fill_a_bucket() -> None:
    """Ids are cheap: 500 contacts from one public /24 hold at most 2 places per bucket
    (and 2 in its replacement cache); contacts from other ranges all get in."""
    own = bytes(20)
    table = RoutingTable(own, k=20)  # the default range limit
    sybils = [Contact(Identity.generate().peer_id, f"1.2.3.{i % 250}:{i}") for i in range(500)]
    honest = [Contact(Identity.generate().peer_id, f"5.{i}.7.8:1") for i in range(15)]
    for contact in [*sybils, *honest]:
        table.add_or_update(contact)
    for bucket in table.buckets:
        for pool in (bucket.contacts, bucket.replacements):
            in_range = [c for c in pool.values() if c.address.startswith("1.2.3.")]
            assert len(in_range) <= 2
    assert all(c.peer_id in table for c in honest)
    assert table.refused_by_range > 0
    # loopback contacts are exempt by default (test swarms), limited when asked
    local = RoutingTable(own, k=20)
    strict = RoutingTable(own, k=20, limit_local=True)
    for i in range(40):
        contact = Contact(Identity.generate().peer_id, f"127.0.0.1:{i + 1}")
        local.add_or_update(contact)
        strict.add_or_update(Contact(contact.peer_id, contact.address))
    assert len(local) > 2 * len(local.buckets) >= len(strict)


def _can_bind(host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:
            return False
    return True


@pytest.mark.skipif(not _can_bind("127.5.5.1"), reason="127.0.0.0/8 is not all loopback here")
async def test_sybil_cluster_in_one_range_cannot_fill_a_bucket() -> None:
    """Real nodes: 12 ids on 127.5.5.x (one /24) and 6 on other /24s join one node that
    limits local ranges too; each of its buckets holds at most 2 of the cluster."""
    config = DHTConfig(run_id="test", limit_local_ranges=True)
    target = await DHTNode.create(config)
    assert target.address is not None
    nodes: list[DHTNode] = []
    try:
        for i in range(12):
            nodes.append(
                await DHTNode.create(
                    DHTConfig(run_id="test", initial_peers=[target.address]),
                    listen=f"127.5.5.{i + 1}:0",
                )
            )
        honest = []
        for i in range(6):
            honest.append(
                await DHTNode.create(
                    DHTConfig(run_id="test", initial_peers=[target.address]),
                    listen=f"127.{20 + i}.0.1:0",
                )
            )
        nodes.extend(honest)
        for node in nodes:  # every node looks up the target, so it hears from each of them
            await node.find_nearest(target.peer_id)
        for bucket in target.routing.buckets:
            for pool in (bucket.contacts, bucket.replacements):
                assert sum(c.address.startswith("127.5.5.") for c in pool.values()) <= 2
        assert all(h.peer_id in target.routing for h in honest)
        assert target.routing.refused_by_range > 0
        # the sybils still reach the target: limits shape its table, not its service
        assert await nodes[0].protocol.call_ping(target.address, expected_id=target.peer_id)
    finally:
        for node in nodes:
            await node.shutdown()
        await target.shutdown()
