"""Protocol keys accept only owner-signed entries of their schema (docs/dht.md).

Attacks over raw DHT RPCs against nodes that carry the averaging layer's key classes
(averaging/protocol_keys.py), as every daemon and bare DHT node of a run does.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest

from swarmavg.averaging.group import Mode
from swarmavg.averaging.matchmaking.declarations import Declaration
from swarmavg.averaging.protocol_keys import protocol_key_classes
from swarmavg.averaging.run_records.progress import PeerProgress
from swarmavg.averaging.state.format import HASH_BYTES
from swarmavg.dht import DHTNode, Identity, RequestSigner, owner_suffix
from swarmavg.dht.identity import address_signature_payload
from swarmavg.dht.ids import key_id
from swarmavg.dht.records import StoredRecord, pack, pack_subkey, signing_payload
from swarmavg.dht.routing import Contact
from swarmavg.peer.daemon.round_reports import RoundLog
from swarmavg.proto import dht_pb2
from tests.dht.swarm import swarm

pytestmark = pytest.mark.timeout(60)

RUN = "test"
S = grpc.StatusCode


def declaration(peer_id: bytes) -> Any:
    now = time.time()
    return Declaration(
        peer_id=peer_id,
        address="127.0.0.1:1",
        start=now,
        deadline=now + 1,
        give_up=now + 2,
        mode=Mode.NODE,
        bandwidth=1.0,
        schema_hash=b"s" * 32,
        group_size=2,
    ).encode()


def advert(peer_id: bytes) -> Any:
    return {"root": b"r" * HASH_BYTES, "version": 1.0, "size": 10, "addr": "127.0.0.1:1"}


def presence(peer_id: bytes) -> Any:
    return {"addr": "127.0.0.1:1", "mode": int(Mode.NODE)}


def progress(peer_id: bytes) -> Any:
    return PeerProgress(peer_id.hex(), 3, 10, 1.0, time.time()).to_record()


def rounds(peer_id: bytes) -> Any:
    return RoundLog().report(peer_id.hex()).to_record()


@dataclass(frozen=True)
class ProtocolKey:
    key: str
    subkey: Callable[[bytes], str]  # the entry an honest peer with this id writes
    value: Callable[[bytes], Any]


PROTOCOL_KEYS = {
    "matchmaking": ProtocolKey(f"{RUN}.k.0b", owner_suffix, declaration),
    "matchmaking-bits": ProtocolKey(f"{RUN}.run.grads.0b0110", owner_suffix, declaration),
    "state": ProtocolKey(f"{RUN}.state", owner_suffix, advert),
    "presence": ProtocolKey(f"{RUN}.averagers", owner_suffix, presence),
    "progress": ProtocolKey(f"{RUN}.progress", lambda p: "a1b2" + owner_suffix(p), progress),
    "diloco-progress": ProtocolKey(
        "run.diloco.progress", lambda p: "a1b2" + owner_suffix(p), progress
    ),
    "round-reports": ProtocolKey(f"{RUN}.rounds", owner_suffix, rounds),
}


def protocol_config(**changes: Any) -> dict[str, Any]:
    return {"run_id": RUN, "key_classes": protocol_key_classes(RUN), **changes}


class Sender:
    """Hand-made requests to one node, from a serving identity of its run."""

    def __init__(self, address: str, receiver_id: bytes, run_id: str = RUN) -> None:
        self.channel = grpc.aio.insecure_channel(address)
        self.receiver_id = receiver_id
        self.identity = Identity.generate()
        self.run_id = run_id
        self.address = "127.0.0.1:9"

    def _signature(self) -> bytes:
        payload = address_signature_payload(self.run_id, self.identity.peer_id, self.address)
        return self.identity.sign(payload)

    def _signed(self, request: Any, method: str) -> Any:
        signer = RequestSigner(self.identity, self.run_id, lambda: self.address)
        return signer.signed(request, self.receiver_id, f"/swarmavg.v1.DHT/{method}")

    async def store(self, records: list[dht_pb2.Record]) -> list[int]:
        request = dht_pb2.StoreRequest(address_signature=self._signature(), records=records)
        self._signed(request, "Store")
        call = self.channel.unary_unary("/swarmavg.v1.DHT/Store")
        data: bytes = await call(request.SerializeToString(), timeout=5)
        return list(dht_pb2.StoreResponse.FromString(data).statuses)

    async def find_storing(self, records: list[dht_pb2.Record]) -> list[int]:
        request = dht_pb2.FindRequest(
            address_signature=self._signature(),
            key_ids=sorted({key_id(r.key) for r in records}),
            store=records,
            replication=20,
        )
        self._signed(request, "Find")
        call = self.channel.unary_unary("/swarmavg.v1.DHT/Find")
        data: bytes = await call(request.SerializeToString(), timeout=5)
        return list(dht_pb2.FindResponse.FromString(data).store_statuses)

    async def close(self) -> None:
        await self.channel.close()


def plain(key: str, value: Any = "x", ttl: float = 3600) -> dht_pb2.Record:
    return dht_pb2.Record(key=key.encode(), value=pack(value), expiration=time.time() + ttl)


def entry(key: str, subkey: Any, value: Any, ttl: float = 3600) -> dht_pb2.Record:
    record = plain(key, value, ttl)
    record.subkey = pack_subkey(subkey)
    return record


def signed(
    identity: Identity,
    key: str,
    subkey: Any,
    value: Any,
    ttl: float = 3600,
    run_id: str = RUN,
    issued: float | None = None,
) -> dht_pb2.Record:
    record = entry(key, subkey, value, ttl)
    record.issued = time.time() if issued is None else issued
    record.public_key = identity.public_key
    record.signature = identity.sign(
        signing_payload(
            run_id, record.key, record.subkey, record.value, record.expiration, record.issued
        )
    )
    return record


def to_proto(record: StoredRecord) -> dht_pb2.Record:
    return dht_pb2.Record(
        key=record.key,
        subkey=record.subkey,
        value=record.value,
        expiration=record.expiration,
        public_key=record.public_key,
        signature=record.signature,
        issued=record.issued,
    )


async def refused(send: Any) -> str:
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await send
    assert info.value.code() == S.INVALID_ARGUMENT, info.value.details()
    return str(info.value.details())


@pytest.fixture
async def pair() -> AsyncIterator[tuple[DHTNode, DHTNode, Sender]]:
    """Two nodes of a run with its protocol keys, and an attacker's channel to the first."""
    async with swarm(2, **protocol_config()) as s:
        target, honest = s.nodes
        assert target.address is not None
        attacker = Sender(target.address, target.peer_id)
        try:
            yield target, honest, attacker
        finally:
            await attacker.close()


@pytest.mark.parametrize("name", list(PROTOCOL_KEYS))
async def test_plain_value_at_a_protocol_key_is_refused_by_the_storing_node(
    pair: tuple[DHTNode, DHTNode, Sender], name: str
) -> None:
    """The confirmed wipe: one plain value with a later expiration used to replace every
    peer's entries and refuse theirs as outdated. Now the storing node refuses it, and
    every other record that is not an owner-signed entry of the key's schema."""
    target, honest, attacker = pair
    spec = PROTOCOL_KEYS[name]
    me = attacker.identity
    details = await refused(attacker.store([plain(spec.key)]))
    assert "owner-signed" in details
    await refused(attacker.find_storing([plain(spec.key)]))  # the store riding on a lookup
    await refused(attacker.store([entry(spec.key, "evil", spec.value(me.peer_id))]))  # unowned
    # correctly signed by its owner, but not of the key's schema
    await refused(attacker.store([signed(me, spec.key, spec.subkey(me.peer_id), "x")]))
    # a well-formed entry whose subkey names someone the attacker cannot sign for
    victim = honest.peer_id
    await refused(attacker.store([signed(me, spec.key, spec.subkey(victim), spec.value(victim))]))
    assert target.storage.get(key_id(spec.key.encode())) == []

    # an owner's own entry of the schema is stored, and the honest peer's store still works
    own = signed(me, spec.key, spec.subkey(me.peer_id), spec.value(me.peer_id))
    assert await attacker.store([own]) == [dht_pb2.STORE_STATUS_STORED]
    expiration = time.time() + 60
    assert await honest.store(spec.key, spec.value(victim), expiration, subkey=spec.subkey(victim))
    found = await honest.get(spec.key, latest=True)
    assert found is not None
    assert set(found.value) == {spec.subkey(me.peer_id), spec.subkey(victim)}


@pytest.mark.parametrize("name", ["matchmaking", "state", "presence", "progress"])
async def test_readers_ignore_a_plain_value_served_by_a_node_that_kept_it(name: str) -> None:
    """A holder without the key classes (an old or hostile node) keeps and serves the plain
    value; readers drop it instead of letting it win the merge over the honest entries."""
    spec = PROTOCOL_KEYS[name]
    async with swarm(3, **protocol_config()) as s:
        (rogue,) = await s.add(1, key_classes=())
        rogue.storage.put(StoredRecord(spec.key.encode(), b"", pack("x"), time.time() + 3600))
        writer, reader = s.nodes[0], s.nodes[1]
        me = writer.peer_id
        stored = await writer.store(
            spec.key, spec.value(me), time.time() + 60, subkey=spec.subkey(me)
        )
        assert stored
        # the rogue answers with its plain value; the reader asks it directly and drops it
        assert rogue.address is not None
        answers = await reader.protocol.call_find(
            Contact(rogue.peer_id, rogue.address), [key_id(spec.key.encode())], 20, True
        )
        assert answers[0].records == []
        found = await reader.get(spec.key, latest=True)
        assert found is not None
        assert isinstance(found.value, dict)
        assert set(found.value) == {spec.subkey(me)}
