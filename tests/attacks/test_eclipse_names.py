"""The anti-eclipse range limit must count networks, not what a peer claims.

A bucket holds at most ``contacts_per_range`` (2) contacts of one address range, because ids
are free and networks are not. On the reviewed code two claims escaped it:

* a DNS name counted as its own range, and anyone can point any number of names at one
  host: 40 names filled a bucket that one /24 may hold 2 places of;
* the address a request's header claims was learned as the sender's whatever address the
  request came from: sybils on one /24 that claim addresses in 10 other /24s were 10
  "networks".

The tests run both attacks from one source, 127.0.0.1, against a real node that applies the
range limits to loopback addresses too (``limit_local_ranges``, so that 127.x.y.z stand for
networks), with control runs: sybils that claim their own /24 are limited to 2 per bucket,
and an honest peer that listens on another /24 than the one its requests come from (as a
peer behind port forwarding or a relay does) is still learned, once it answered at the address
it claims. No name is ever resolved: the names are under ``.invalid``.
"""

from __future__ import annotations

import asyncio
import socket
from collections.abc import Iterable

import grpc
import pytest

from swarmavg.dht import DHTConfig, DHTNode, Identity
from swarmavg.dht.auth import message_digest, sign_request
from swarmavg.dht.identity import address_signature_payload
from swarmavg.dht.routing import Contact, RoutingTable
from swarmavg.proto import dht_pb2

pytestmark = pytest.mark.timeout(120)

RUN = "test"
PING = "/swarmavg.v1.DHT/Ping"
PER_RANGE = 2  # DHTConfig.contacts_per_range's default
SYBILS = 10  # fewer than k: no bucket overflows, so no contact is ever pinged by the table


def _can_bind(host: str) -> bool:
    with socket.socket() as s:
        try:
            s.bind((host, 0))
        except OSError:
            return False
    return True


needs_loopback_8 = pytest.mark.skipif(
    not _can_bind("127.50.0.1"), reason="127.0.0.0/8 is not all loopback here"
)


async def claim(
    channel: grpc.aio.Channel, sender: Identity, receiver_id: bytes, address: str
) -> None:
    """A Ping signed by ``sender`` that claims ``address`` (with a valid address binding)."""
    request = dht_pb2.PingRequest(
        address_signature=sender.sign(address_signature_payload(RUN, sender.peer_id, address))
    )
    header = sign_request(sender, RUN, address, receiver_id, PING, message_digest(request))
    request.header.CopyFrom(header)
    await channel.unary_unary(PING)(request.SerializeToString(), timeout=30)


def most_per_bucket(table: RoutingTable, ids: Iterable[bytes]) -> int:
    """The most of ``ids`` that one bucket (or its replacement cache) holds."""
    wanted = set(ids)
    return max(
        (
            sum(peer_id in wanted for peer_id in pool)
            for bucket in table.buckets
            for pool in (bucket.contacts, bucket.replacements)
        ),
        default=0,
    )


async def target_node() -> tuple[DHTNode, grpc.aio.Channel]:
    node = await DHTNode.create(DHTConfig(run_id=RUN, limit_local_ranges=True))
    assert node.address is not None
    return node, grpc.aio.insecure_channel(node.address)


async def test_sybils_that_claim_dns_names_take_no_more_than_one_range() -> None:
    target, channel = await target_node()
    try:
        # control: sybils claiming their own /24 (where their requests come from): 2 a bucket
        own = [Identity.generate() for _ in range(SYBILS)]
        for i, sybil in enumerate(own):
            await claim(channel, sybil, target.peer_id, f"127.0.0.1:{40000 + i}")
        assert 1 <= most_per_bucket(target.routing, (s.peer_id for s in own)) <= PER_RANGE

        # the attack: each sybil claims a name of its own
        named = [Identity.generate() for _ in range(SYBILS)]
        for i, sybil in enumerate(named):
            await claim(channel, sybil, target.peer_id, f"sybil{i}.invalid:31337")
        assert most_per_bucket(target.routing, (s.peer_id for s in named)) <= PER_RANGE
        everyone = [s.peer_id for s in own + named]
        assert most_per_bucket(target.routing, everyone) <= 2 * PER_RANGE
    finally:
        await channel.close()
        await target.shutdown()


@needs_loopback_8
async def test_sybils_that_claim_other_ranges_are_not_learned_there() -> None:
    target, channel = await target_node()
    honest_identity = Identity.generate()
    learned = asyncio.Event()
    add_or_update = target.routing.add_or_update

    def watch(contact: Contact) -> Contact | None:
        result = add_or_update(contact)
        if contact.peer_id == honest_identity.peer_id and contact.peer_id in target.routing:
            learned.set()
        return result

    target.routing.add_or_update = watch  # type: ignore[method-assign]
    honest: DHTNode | None = None
    try:
        # the attack: from 127.0.0.1, sybils claim addresses in 10 other /24s (nobody there)
        sybils = [Identity.generate() for _ in range(SYBILS)]
        for i, sybil in enumerate(sybils):
            await claim(channel, sybil, target.peer_id, f"127.{60 + i}.0.1:31337")

        # control: an honest peer listens on 127.50.0.1 while its requests come from
        # 127.0.0.1 (another /24, as behind port forwarding or a relay): it is learned, at
        # the address it claims
        assert target.address is not None
        honest = await DHTNode.create(
            DHTConfig(run_id=RUN, initial_peers=[target.address]),
            identity=honest_identity,
            listen="127.50.0.1:0",
        )
        await asyncio.wait_for(learned.wait(), timeout=60)
        known = target.routing.get(honest.peer_id)
        assert known is not None
        assert known.address == honest.address

        # honest outcome: no sybil was learned at an address it does not answer at
        assert most_per_bucket(target.routing, (s.peer_id for s in sybils)) == 0
    finally:
        await channel.close()
        if honest is not None:
            await honest.shutdown()
        await target.shutdown()


def test_dns_names_share_one_range_in_the_routing_table() -> None:
    """Contacts learned at names (answers at a dialled name, bootstrap peers): 40 names
    count as one range, 15 contacts on 15 /24s all get in."""
    table = RoutingTable(bytes(20), k=20)  # the default range limit
    named = [Contact(Identity.generate().peer_id, f"sybil{i}.invalid:31337") for i in range(40)]
    honest = [Contact(Identity.generate().peer_id, f"5.{i}.7.8:1") for i in range(15)]
    for contact in [*named, *honest]:
        table.add_or_update(contact)
    assert most_per_bucket(table, (c.peer_id for c in named)) <= PER_RANGE
    assert all(c.peer_id in table for c in honest)
