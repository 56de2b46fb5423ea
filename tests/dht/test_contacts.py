"""Contacts are learned only from their owners; one address range cannot fill a bucket.

The routing hijack of issue 16: a node answers a lookup with ``(victim id, attacker
address)`` and then answers, at that address, with the victim's public key copied into its
header. The querier must keep the victim's real address, and the fake address must never
enter its table (the attacker cannot sign the victim's binding of that address).
"""

from __future__ import annotations

import socket
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager

import grpc
import pytest

from swarmavg.dht import DHTConfig, DHTNode, Identity
from swarmavg.dht.identity import address_signature_payload
from swarmavg.dht.ranges import address_range, grpc_peer_host, limited_range
from swarmavg.dht.routing import Contact, RoutingTable
from swarmavg.dht.traversal import traverse
from swarmavg.proto import common_pb2, dht_pb2

pytestmark = pytest.mark.timeout(60)

Answer = Callable[[str, bytes], bytes]  # (method, request bytes) -> answer bytes


@asynccontextmanager
async def fake_dht(answer: Answer, host: str = "127.0.0.1") -> AsyncIterator[str]:
    """A hand-written DHT service on a real port; yields its HOST:PORT."""

    def handler(method: str) -> grpc.RpcMethodHandler:
        async def behavior(request: bytes, context: object) -> bytes:
            return answer(method, request)

        return grpc.unary_unary_rpc_method_handler(behavior)

    server = grpc.aio.server()
    methods = {m: handler(m) for m in ("Ping", "Store", "Find")}
    server.add_generic_rpc_handlers(
        (grpc.method_handlers_generic_handler("swarmavg.v1.DHT", methods),)
    )
    port = server.add_insecure_port(f"{host}:0")
    await server.start()
    try:
        yield f"{host}:{port}"
    finally:
        await server.stop(None)


def _distance(a: bytes, b: bytes) -> int:
    return int.from_bytes(a, "big") ^ int.from_bytes(b, "big")


def _closed_address() -> str:
    """A loopback address where nothing listens (a port the OS gave us, then closed)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return f"127.0.0.1:{s.getsockname()[1]}"


def binding(identity: Identity, address: str) -> bytes:
    return identity.sign(address_signature_payload("test", identity.peer_id, address))


def with_binding(answer: bytes, signature: bytes) -> bytes:
    """``answer`` with ``address_signature`` (field 15, bytes) appended, written by hand so that
    the same fake answers run against code whose protos lack the field (it is then ignored)."""
    return answer + bytes([15 << 3 | 2, len(signature)]) + signature


def find_answer(
    request: bytes, header: common_pb2.RequestHeader, signature: bytes, named: list[Contact]
) -> bytes:
    """A well-formed Find answer that names ``named`` as the nearest peers to every id."""
    find = dht_pb2.FindRequest.FromString(request)
    response = dht_pb2.FindResponse(header=header)
    for _ in find.key_ids:
        result = response.results.add()
        for c in named:
            result.nearest.add(peer_id=c.peer_id, address=c.address)
    response.store_statuses.extend([dht_pb2.STORE_STATUS_STORED] * len(find.store))
    return with_binding(response.SerializeToString(), signature)


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
    front = Identity.generate()  # the attacker's own, honest-looking node
    posing: dict[str, str] = {}  # the address that answers as the victim

    def as_victim(method: str, request: bytes) -> bytes:
        # the victim's public key copied, its real binding replayed; the header claims either
        # the attacker's address or the victim's
        header = common_pb2.RequestHeader()
        header.CopyFrom(victim.protocol.header)
        if claimed == "attacker":
            header.address = posing["address"]
        signature = binding(victim.identity, victim.protocol.address)  # as replayed from a request
        if method == "Find":
            return find_answer(request, header, signature, [])
        return with_binding(dht_pb2.PingResponse(header=header).SerializeToString(), signature)

    try:
        async with fake_dht(as_victim) as fake_address:
            posing["address"] = fake_address
            hearsay = [Contact(victim.peer_id, fake_address)]

            def as_front(method: str, request: bytes) -> bytes:
                header = front.make_header("test", posing["front"])
                return find_answer(request, header, binding(front, posing["front"]), hearsay)

            async with fake_dht(as_front) as front_address:
                posing["front"] = front_address
                # the front makes itself known to the querier with a valid, own request
                channel = grpc.aio.insecure_channel(querier.address)
                ping = dht_pb2.PingRequest(
                    header=front.make_header("test", front_address),
                    address_signature=binding(front, front_address),
                )
                await channel.unary_unary("/swarmavg.v1.DHT/Ping")(
                    ping.SerializeToString(), timeout=5
                )
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
        known = querier.routing.get(victim.peer_id)
        if victim_known:
            assert known is not None
            assert known.address == victim.address
        else:
            assert known is None
        assert all(c.address != fake_address for c in querier.routing)
        # a known victim is dialled at its known address; an unknown one at the named address,
        # whose answer proves nothing and is refused
        assert (querier.protocol.unproven_answers >= 1) != victim_known
        assert lookups[front.peer_id].nearest[-1].address != fake_address
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
    assert address_range("Example.org:1") == ("example.org", False)
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
