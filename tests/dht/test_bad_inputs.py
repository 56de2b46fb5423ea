"""Hostile requests get an error status and change nothing (storage and routing table)."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import grpc
import pytest
from google.protobuf.message import DecodeError

from swarmavg.dht import DHTConfig, DHTLimits, DHTNode, Identity, RequestSigner
from swarmavg.dht.identity import PROTOCOL_VERSION, address_signature_payload
from swarmavg.dht.ids import key_id
from swarmavg.dht.records import owner_suffix, pack, pack_subkey, signing_payload
from swarmavg.proto import common_pb2, dht_pb2

REQUEST_TYPES: dict[str, type[Any]] = {
    "Ping": dht_pb2.PingRequest,
    "Store": dht_pb2.StoreRequest,
    "Find": dht_pb2.FindRequest,
}

pytestmark = pytest.mark.timeout(60)

LIMITS = DHTLimits(
    max_key_bytes=64,
    max_value_bytes=1024,
    max_records_per_request=8,
    max_keys_per_request=8,
    max_request_bytes=64 * 1024,
)


class Attacker:
    """Sends hand-made requests to one node."""

    def __init__(self, channel: grpc.aio.Channel, receiver_id: bytes, run_id: str = "test") -> None:
        self.channel = channel
        self.receiver_id = receiver_id  # the target node's id, which signatures name
        self.identity = Identity.generate()
        self.run_id = run_id
        self.address = "127.0.0.1:9"
        self.victim: DHTNode | None = None  # an honest node the attacker tries to pose as

    def header(self, **changes: object) -> common_pb2.RequestHeader:
        header = self.identity.make_header(self.run_id, self.address)
        for name, value in changes.items():
            setattr(header, name, value)
        return header

    def signature(self) -> bytes:
        payload = address_signature_payload(self.run_id, self.identity.peer_id, self.address)
        return self.identity.sign(payload)

    def _signed(self, method: str, body: bytes) -> bytes:
        """``body`` signed by the attacker's own key when its header is the attacker's own
        unsigned one: these tests probe the checks behind the signature. The header's other
        fields (run, version, id) are kept as the test set them."""
        try:
            request = REQUEST_TYPES[method].FromString(body)
        except DecodeError:
            return body
        header = request.header
        if header.public_key != self.identity.public_key or header.signature:
            return body
        wanted = common_pb2.RequestHeader()
        wanted.CopyFrom(header)
        signer = RequestSigner(self.identity, self.run_id, lambda: self.address)
        signer.signed(request, self.receiver_id, f"/swarmavg.v1.DHT/{method}")
        for name in ("run_id", "protocol_version", "peer_id", "address"):
            setattr(request.header, name, getattr(wanted, name))
        return request.SerializeToString()

    async def raw(self, method: str, body: bytes) -> bytes:
        call = self.channel.unary_unary(f"/swarmavg.v1.DHT/{method}")
        data: bytes = await call(self._signed(method, body), timeout=5)
        return data

    async def store(self, records: list[dht_pb2.Record], **header: object) -> bytes:
        request = dht_pb2.StoreRequest(
            header=self.header(**header), address_signature=self.signature(), records=records
        )
        return await self.raw("Store", request.SerializeToString())


def record(key: bytes = b"k", value: object = 1, subkey: object = None) -> dht_pb2.Record:
    return dht_pb2.Record(
        key=key,
        subkey=b"" if subkey is None else pack_subkey(subkey),  # type: ignore[arg-type]
        value=pack(value),
        expiration=time.time() + 60,
    )


@pytest.fixture
async def target() -> AsyncIterator[tuple[DHTNode, Attacker]]:
    """A node whose routing table holds one honest friend; the attacker's channel to it."""
    node = await DHTNode.create(DHTConfig(run_id="test", limits=LIMITS))
    assert node.address is not None
    friend = await DHTNode.create(DHTConfig(run_id="test", initial_peers=[node.address]))
    assert friend.peer_id in node.routing
    channel = grpc.aio.insecure_channel(node.address)
    attacker = Attacker(channel, node.peer_id)
    attacker.victim = friend
    try:
        yield node, attacker
    finally:
        await channel.close()
        await friend.shutdown()
        await node.shutdown()


def snapshot(node: DHTNode) -> tuple[int, int, list[tuple[bytes, str]]]:
    return (
        len(node.storage),
        node.storage.bytes_used,
        sorted((c.peer_id, c.address) for c in node.routing),
    )


async def expect_error(code: grpc.StatusCode, send: Callable[[], object]) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await send()  # type: ignore[misc]
    assert info.value.code() == code, info.value.details()
    return str(info.value.details())


async def test_valid_store_is_accepted(target: tuple[DHTNode, Attacker]) -> None:
    node, attacker = target
    answer = dht_pb2.StoreResponse.FromString(await attacker.store([record()]))
    assert list(answer.statuses) == [dht_pb2.STORE_STATUS_STORED]
    assert answer.header.peer_id == node.peer_id
    assert attacker.identity.peer_id in node.routing  # a valid sender is learned


async def test_malformed_and_oversized_requests(target: tuple[DHTNode, Attacker]) -> None:
    node, attacker = target
    before = snapshot(node)
    S = grpc.StatusCode
    await expect_error(S.INVALID_ARGUMENT, lambda: attacker.raw("Store", b"\xff\xff\xff"))
    await expect_error(S.INVALID_ARGUMENT, lambda: attacker.raw("Find", b"\x0a\x05ab"))
    await expect_error(S.RESOURCE_EXHAUSTED, lambda: attacker.raw("Store", b"\x00" * 70_000))
    details = await expect_error(
        S.INVALID_ARGUMENT, lambda: attacker.store([record(key=b"k" * 65)])
    )
    assert "key" in details
    await expect_error(S.INVALID_ARGUMENT, lambda: attacker.store([record(value=b"v" * 2000)]))
    await expect_error(S.INVALID_ARGUMENT, lambda: attacker.store([record()] * 9))
    bad_value = record()
    bad_value.value = b"\xc1"  # never valid msgpack
    await expect_error(S.INVALID_ARGUMENT, lambda: attacker.store([bad_value]))
    far_future = record()
    far_future.expiration = time.time() + 365 * 24 * 3600
    await expect_error(S.INVALID_ARGUMENT, lambda: attacker.store([far_future]))
    # one bad record spoils the whole batch: nothing of it is stored
    await expect_error(
        S.INVALID_ARGUMENT, lambda: attacker.store([record(key=b"good"), record(key=b"b" * 99)])
    )
    find = dht_pb2.FindRequest(
        header=attacker.header(), address_signature=attacker.signature(), key_ids=[b"short"]
    )
    await expect_error(S.INVALID_ARGUMENT, lambda: attacker.raw("Find", find.SerializeToString()))
    find = dht_pb2.FindRequest(
        header=attacker.header(), address_signature=attacker.signature(), key_ids=[b"x" * 20] * 9
    )
    await expect_error(S.INVALID_ARGUMENT, lambda: attacker.raw("Find", find.SerializeToString()))
    assert snapshot(node) == before


async def test_wrong_run_version_and_spoofed_ids(target: tuple[DHTNode, Attacker]) -> None:
    node, attacker = target
    before = snapshot(node)
    S = grpc.StatusCode
    details = await expect_error(
        S.FAILED_PRECONDITION, lambda: attacker.store([record()], run_id="other")
    )
    assert "run" in details
    await expect_error(
        S.FAILED_PRECONDITION,
        lambda: attacker.store([record()], protocol_version=PROTOCOL_VERSION + 1),
    )
    victim = attacker.victim
    assert victim is not None
    # claiming another node's id with our own key: the key does not hash to that id
    details = await expect_error(
        S.FAILED_PRECONDITION, lambda: attacker.store([record()], peer_id=victim.peer_id)
    )
    assert "does not match" in details
    # copying the victim's public key too: the header checks out, but the address signature
    # (made with the attacker's key) does not, so the victim's routing entry cannot be hijacked
    ping = dht_pb2.PingRequest(
        header=victim.identity.make_header("test", victim.address or ""),
        address_signature=attacker.signature(),
    )
    ping.header.address = attacker.address
    await expect_error(S.UNAUTHENTICATED, lambda: attacker.raw("Ping", ping.SerializeToString()))
    # nor by replaying the victim's own address signature with another address
    assert victim.address is not None
    victim_signature = victim.identity.sign(  # what the victim sends with each request
        address_signature_payload("test", victim.peer_id, victim.address)
    )
    replay = dht_pb2.PingRequest(
        header=victim.identity.make_header("test", victim.address),
        address_signature=victim_signature,
    )
    replay.header.address = attacker.address
    await expect_error(S.UNAUTHENTICATED, lambda: attacker.raw("Ping", replay.SerializeToString()))
    assert snapshot(node) == before
    entry = node.routing.get(victim.peer_id)
    assert entry is not None
    assert entry.address == victim.address


async def test_forged_owner_records_are_rejected(target: tuple[DHTNode, Attacker]) -> None:
    node, attacker = target
    owner = Identity.generate()
    key = ("slot" + owner_suffix(owner.peer_id)).encode()
    exp = time.time() + 60
    value = pack("mine")
    genuine = dht_pb2.Record(
        key=key,
        value=value,
        expiration=exp,
        public_key=owner.public_key,
        signature=owner.sign(signing_payload("test", key, b"", value, exp, exp - 60)),
        issued=exp - 60,
    )
    await attacker.store([genuine])  # a correctly signed record may be relayed by anyone
    before = snapshot(node)
    S = grpc.StatusCode
    forged_value = pack("stolen")
    later = exp + 30
    forged = dht_pb2.Record(
        key=key,
        value=forged_value,
        expiration=later,
        public_key=attacker.identity.public_key,
        signature=attacker.identity.sign(
            signing_payload("test", key, b"", forged_value, later, exp)
        ),
        issued=exp,
    )
    await expect_error(S.INVALID_ARGUMENT, lambda: attacker.store([forged]))
    replayed_sig = dht_pb2.Record()
    replayed_sig.CopyFrom(genuine)
    replayed_sig.expiration = later  # reuse the owner's signature on a changed record
    await expect_error(S.INVALID_ARGUMENT, lambda: attacker.store([replayed_sig]))
    unsigned = dht_pb2.Record(key=key, value=forged_value, expiration=later)
    await expect_error(S.INVALID_ARGUMENT, lambda: attacker.store([unsigned]))
    assert snapshot(node) == before
    found = await node.get(key)  # merges the node's own records with a lookup
    assert found is not None
    assert found.value == "mine"


async def test_records_riding_on_find_are_checked(target: tuple[DHTNode, Attacker]) -> None:
    node, attacker = target
    owner = Identity.generate()
    key = ("slot" + owner_suffix(owner.peer_id)).encode()
    forged_value = pack("stolen")
    exp = time.time() + 60
    forged = dht_pb2.Record(
        key=key,
        value=forged_value,
        expiration=exp,
        public_key=attacker.identity.public_key,
        signature=attacker.identity.sign(
            signing_payload("test", key, b"", forged_value, exp, exp - 60)
        ),
        issued=exp - 60,
    )
    before = snapshot(node)

    def find(records: list[dht_pb2.Record], key_ids: list[bytes]) -> bytes:
        return dht_pb2.FindRequest(
            header=attacker.header(),
            address_signature=attacker.signature(),
            key_ids=key_ids,
            store=records,
            replication=20,
        ).SerializeToString()

    S = grpc.StatusCode
    await expect_error(
        S.INVALID_ARGUMENT, lambda: attacker.raw("Find", find([forged], [key_id(key)]))
    )
    details = await expect_error(
        S.INVALID_ARGUMENT, lambda: attacker.raw("Find", find([record()], [key_id(b"other")]))
    )
    assert "not asked" in details
    await expect_error(
        S.INVALID_ARGUMENT, lambda: attacker.raw("Find", find([record()] * 9, [key_id(b"k")]))
    )
    assert snapshot(node) == before
    # a valid one is stored (the node knows fewer than 20 nodes, so it is among the nearest)
    answer = dht_pb2.FindResponse.FromString(
        await attacker.raw("Find", find([record()], [key_id(b"k")]))
    )
    assert list(answer.store_statuses) == [dht_pb2.STORE_STATUS_STORED]
    assert node.storage.get(key_id(b"k")) != []


async def test_node_keeps_serving_after_bad_requests(target: tuple[DHTNode, Attacker]) -> None:
    node, attacker = target
    for _ in range(3):
        with pytest.raises(grpc.aio.AioRpcError):
            await attacker.raw("Store", b"\xff" * 10)
    ping = dht_pb2.PingRequest(header=attacker.header(), address_signature=attacker.signature())
    answer = dht_pb2.PingResponse.FromString(await attacker.raw("Ping", ping.SerializeToString()))
    assert answer.header.peer_id == node.peer_id
