"""Owned records: the signature covers the run id and the time the owner signed, so a record
cannot be replayed into another run, nor over its owner's newer version.

A captured record is replayed through a raw DHT ``Store`` from a serving identity of the
target's run, as an eavesdropper or a former holder of the record could.
"""

from __future__ import annotations

import time

import grpc
import pytest

from swarmavg.dht import Identity, RequestSigner, owner_suffix
from swarmavg.dht.identity import address_signature_payload
from swarmavg.dht.ids import key_id
from swarmavg.dht.records import StoredRecord
from swarmavg.proto import dht_pb2
from tests.dht.swarm import swarm

pytestmark = pytest.mark.timeout(60)


async def replay(address: str, receiver_id: bytes, run_id: str, record: StoredRecord) -> list[int]:
    """Send ``record`` unchanged in a raw ``Store`` to ``address`` (the node ``receiver_id``),
    signed by a fresh identity; return the statuses."""
    identity = Identity.generate()
    own = "127.0.0.1:9"
    signature = identity.sign(address_signature_payload(run_id, identity.peer_id, own))
    request = dht_pb2.StoreRequest(
        address_signature=signature,
        records=[
            dht_pb2.Record(
                key=record.key,
                subkey=record.subkey,
                value=record.value,
                expiration=record.expiration,
                public_key=record.public_key,
                signature=record.signature,
                issued=record.issued,
            )
        ],
    )
    signer = RequestSigner(identity, run_id, lambda: own)
    signer.signed(request, receiver_id, "/swarmavg.v1.DHT/Store")
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary("/swarmavg.v1.DHT/Store")
        data: bytes = await call(request.SerializeToString(), timeout=5)
    return list(dht_pb2.StoreResponse.FromString(data).statuses)


async def test_an_owned_record_cannot_be_replayed_into_another_run() -> None:
    """A record its owner signed in one run is refused in any other, even under the same key
    and long before it expires."""
    key = "model.progress-board"
    async with swarm(1, run_id="run-a") as a:
        owner = a.nodes[0]
        subkey = owner_suffix(owner.peer_id)
        assert await owner.store(key, {"epoch": 7}, time.time() + 600, subkey=subkey)
        (captured,) = owner.storage.get(key_id(key.encode()))
        async with swarm(1, run_id="run-b") as b:
            newer = b.nodes[0]
            assert newer.address is not None
            with pytest.raises(grpc.aio.AioRpcError) as info:
                await replay(newer.address, newer.peer_id, "run-b", captured)
            assert info.value.code() == grpc.StatusCode.INVALID_ARGUMENT
            assert "another run" in str(info.value.details())
            assert newer.storage.get(key_id(key.encode())) == []
            assert await newer.get(key, latest=True) is None


async def test_an_owner_replaces_its_record_and_an_old_version_cannot_be_replayed() -> None:
    """Of an owner's versions the later-signed one wins whatever the expirations: the owner
    can retire its record early, and a captured older version, replayed to its holders,
    loses to the newer one there and in every reader's merge."""
    async with swarm(3, run_id="test") as s:
        owner, reader = s.nodes[0], s.nodes[1]
        key = "test.board"
        subkey = owner_suffix(owner.peer_id)
        assert await owner.store(key, {"epoch": 7}, time.time() + 600, subkey=subkey)
        old = next(rec for node in s.nodes for rec in node.storage.get(key_id(key.encode())))
        soon = time.time() + 30  # the newer version expires sooner than the one it replaces
        assert await owner.store(key, {"left": True}, soon, subkey=subkey)
        holders = 0
        for node in s.nodes:
            held = [r.expiration for r in node.storage.get(key_id(key.encode()))]
            assert node.address is not None
            statuses = await replay(node.address, node.peer_id, "test", old)
            if held == [soon]:  # a holder of the newer version keeps it
                holders += 1
                assert statuses == [dht_pb2.STORE_STATUS_OUTDATED]
        assert holders >= 1
        found = await reader.get(key, latest=True)
        assert found is not None
        assert found.value[subkey].value == {"left": True}
        assert found.value[subkey].expiration == soon


async def test_an_owner_pays_no_verification_for_its_own_new_record() -> None:
    """The record a node signs is entered in its signature cache as it is made: validating it
    before the store, and reading it back from the swarm, cost the owner no Ed25519
    verification (they did one per version before); the other nodes still verify it."""
    async with swarm(3, run_id="test") as s:
        owner, other = s.nodes[0], s.nodes[1]
        key = "test.board"
        subkey = owner_suffix(owner.peer_id)
        before = owner.protocol.signatures.misses
        assert await owner.store(key, {"epoch": 1}, time.time() + 600, subkey=subkey)
        found = await owner.get(key, latest=True)
        assert found is not None
        assert found.value[subkey].value == {"epoch": 1}
        assert owner.protocol.signatures.misses == before
        assert other.protocol.signatures.misses > 0


async def test_open_records_keep_the_later_expiration_rule() -> None:
    """Records that name no owner carry no issue time: the later expiration still wins."""
    async with swarm(2, run_id="test") as s:
        a, b = s.nodes
        assert await a.store("open", 1, time.time() + 60)
        assert not await b.store("open", 2, time.time() + 30)
        found = await b.get("open", latest=True)
        assert found is not None
        assert found.value == 1
