"""Every DHT request and answer proves its sender: copies and replays are refused.

A public key is public (it is in every header and signed record), and a peer's address
signature carries no time, so on code without message signatures an outsider that copies
both speaks as that peer. These tests send such copies over real gRPC to real nodes.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from typing import Any

import grpc
import pytest

from swarmavg.dht import DHTConfig, DHTNode, Identity
from swarmavg.dht.identity import address_signature_payload
from swarmavg.dht.ids import key_id
from swarmavg.dht.protocol import DHTRPCError
from swarmavg.dht.records import pack
from swarmavg.proto import dht_pb2

pytestmark = pytest.mark.timeout(60)

RUN = "test"
REQUESTS: dict[str, type[Any]] = {
    "Ping": dht_pb2.PingRequest,
    "Store": dht_pb2.StoreRequest,
    "Find": dht_pb2.FindRequest,
}
ANSWERS: dict[str, type[Any]] = {
    "Ping": dht_pb2.PingResponse,
    "Store": dht_pb2.StoreResponse,
    "Find": dht_pb2.FindResponse,
}


@pytest.fixture
async def nodes() -> AsyncIterator[tuple[DHTNode, DHTNode, DHTNode]]:
    """A target, a victim the target knows (whose identity outsiders copy), and a third."""
    target = await DHTNode.create(DHTConfig(run_id=RUN))
    assert target.address is not None
    victim = await DHTNode.create(DHTConfig(run_id=RUN, initial_peers=[target.address]))
    third = await DHTNode.create(DHTConfig(run_id=RUN, initial_peers=[target.address]))
    assert victim.peer_id in target.routing
    try:
        yield target, victim, third
    finally:
        for node in (third, victim, target):
            await node.shutdown()


def plain_record(key: bytes) -> dht_pb2.Record:
    return dht_pb2.Record(key=key, value=pack("forged"), expiration=time.time() + 600)


def body(method: str, key: bytes) -> Any:
    """A request of ``method`` that acts on ``key`` (without its header)."""
    if method == "Store":
        return dht_pb2.StoreRequest(records=[plain_record(key)])
    if method == "Find":
        return dht_pb2.FindRequest(key_ids=[key_id(key)], k=5, want_values=True)
    return dht_pb2.PingRequest()


async def send(address: str, method: str, request: Any) -> Any:
    async with grpc.aio.insecure_channel(address) as channel:
        call = channel.unary_unary(f"/swarmavg.v1.DHT/{method}")
        data: bytes = await call(request.SerializeToString(), timeout=5)
    return ANSWERS[method].FromString(data)


def copied_request(victim: DHTNode, method: str, key: bytes, signature: str) -> Any:
    """``method`` in ``victim``'s name: its header and its (timeless) address signature,
    copied; ``signature`` "none" leaves the request unsigned, "own" signs it with an
    outsider's key over exactly what the victim would have signed."""
    assert victim.address is not None
    request = body(method, key)
    request.header.CopyFrom(victim.identity.make_header(RUN, victim.address))
    request.address_signature = victim.identity.sign(
        address_signature_payload(RUN, victim.peer_id, victim.address)
    )
    if signature == "own":
        from swarmavg.dht.auth import RequestSigner

        outsider = RequestSigner(Identity.generate(), RUN, lambda: victim.address or "")
        signed = outsider.signed(body(method, key), b"", f"/swarmavg.v1.DHT/{method}")
        signed.address_signature = request.address_signature
        signed.header.peer_id = victim.peer_id
        signed.header.public_key = victim.identity.public_key
        request = signed
    return request


@pytest.mark.parametrize("signature", ["none", "own"])
@pytest.mark.parametrize("method", ["Store", "Find", "Ping"])
async def test_a_copied_header_is_refused(
    nodes: tuple[DHTNode, DHTNode, DHTNode], method: str, signature: str
) -> None:
    target, victim, _ = nodes
    assert target.address is not None
    key = b"test.board"
    request = copied_request(victim, method, key, signature)
    if signature == "own":  # addressed like a real request, so only the signature is wrong
        request.header.receiver_id = target.peer_id
    stored_before = len(target.storage)
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await send(target.address, method, request)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED, info.value.details()
    assert "signature" in str(info.value.details()) or "signed" in str(info.value.details())
    assert len(target.storage) == stored_before
    assert target.storage.get(key_id(key), time.time()) == []


def signed_by(node: DHTNode, receiver: DHTNode | None, method: str, key: bytes) -> Any:
    """A genuine request of ``node`` to ``receiver`` (``None``: an unaddressed one), as
    ``node`` sends it (a capture)."""
    request = body(method, key)
    request.address_signature = node.identity.sign(
        address_signature_payload(RUN, node.peer_id, node.address or "")
    )
    receiver_id = b"" if receiver is None else receiver.peer_id
    return node.signer.signed(request, receiver_id, f"/swarmavg.v1.DHT/{method}")


@pytest.mark.parametrize("method", ["Store", "Find", "Ping"])
async def test_a_replayed_request_is_refused_inside_and_after_the_window(
    nodes: tuple[DHTNode, DHTNode, DHTNode], method: str
) -> None:
    target, victim, _ = nodes
    assert target.address is not None
    captured = signed_by(victim, target, method, b"test.fresh")
    answer = await send(target.address, method, captured)  # the genuine request passes
    assert answer.header.peer_id == target.peer_id
    with pytest.raises(grpc.aio.AioRpcError) as info:  # inside the window: the nonce is spent
        await send(target.address, method, captured)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "replay" in str(info.value.details())

    later = signed_by(victim, target, method, b"test.late")
    window = target.authenticator.window
    target.authenticator.clock = lambda: time.time() + window + 1  # the receiver is later
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await send(target.address, method, later)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "timestamp" in str(info.value.details())


@pytest.mark.parametrize("method", ["Store", "Find", "Ping"])
async def test_a_request_for_another_receiver_is_refused(
    nodes: tuple[DHTNode, DHTNode, DHTNode], method: str
) -> None:
    target, victim, third = nodes
    assert third.address is not None
    captured = signed_by(victim, target, method, b"test.k")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await send(third.address, method, captured)
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
    assert "another receiver" in str(info.value.details())
    # nor can the method be changed under the signature
    captured_ping = signed_by(victim, target, "Ping", b"")
    with pytest.raises(grpc.aio.AioRpcError) as info:
        await send(target.address or "", "Find", dht_pb2.FindRequest(header=captured_ping.header))
    assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED


async def test_a_store_names_its_receiver() -> None:
    """Only a bootstrap Ping or Find may leave the receiver empty (its id is not known yet)."""
    async with _pair() as (target, sender):
        request = signed_by(sender, None, "Store", b"test.k")
        with pytest.raises(grpc.aio.AioRpcError) as info:
            await send(target.address or "", "Store", request)
        assert info.value.code() == grpc.StatusCode.UNAUTHENTICATED
        assert "no receiver" in str(info.value.details())
        ping = signed_by(sender, None, "Ping", b"")
        assert (await send(target.address or "", "Ping", ping)).header.peer_id == target.peer_id


class _pair:
    def __init__(self) -> None:
        self.nodes: list[DHTNode] = []

    async def __aenter__(self) -> tuple[DHTNode, DHTNode]:
        target = await DHTNode.create(DHTConfig(run_id=RUN))
        self.nodes.append(target)
        sender = await DHTNode.create(DHTConfig(run_id=RUN))
        self.nodes.append(sender)
        return target, sender

    async def __aexit__(self, *_: object) -> None:
        for node in self.nodes:
            await node.shutdown()


class FakeResponder:
    """A DHT server that answers every call with fixed bytes (a forger's answers)."""

    def __init__(self) -> None:
        self.answer = b""
        self.calls = 0

    async def handle(self, request: bytes, context: Any) -> bytes:
        self.calls += 1
        return self.answer

    async def start(self) -> tuple[grpc.aio.Server, str]:
        server = grpc.aio.server()
        handlers = {m: grpc.unary_unary_rpc_method_handler(self.handle) for m in REQUESTS}
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("swarmavg.v1.DHT", handlers),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
        return server, f"127.0.0.1:{port}"


@pytest.mark.parametrize("forgery", ["copied", "replayed"])
async def test_a_forged_answer_is_refused_by_the_caller(
    nodes: tuple[DHTNode, DHTNode, DHTNode], forgery: str
) -> None:
    """An outsider answers in the victim's name (a copied header, or the victim's genuine
    answer to another request): the caller refuses it like a failed call, and its routing
    table keeps the victim at the victim's address."""
    caller, victim, _ = nodes
    assert victim.address is not None
    fake = FakeResponder()
    if forgery == "copied":
        fake.answer = dht_pb2.PingResponse(
            header=victim.identity.make_header(RUN, victim.address)
        ).SerializeToString()
    else:  # a genuine, signed answer of the victim, captured from an earlier exchange
        genuine = await send(victim.address, "Ping", signed_by(caller, victim, "Ping", b""))
        fake.answer = genuine.SerializeToString()
    server, fake_address = await fake.start()
    try:
        with pytest.raises(DHTRPCError):
            await caller.protocol.call_ping(fake_address, expected_id=victim.peer_id)
        with pytest.raises(DHTRPCError):  # bootstrap case: the caller does not know the id
            await caller.protocol.call_ping(fake_address)
        assert fake.calls == 2
        entry = caller.routing.get(victim.peer_id)
        assert entry is None or entry.address == victim.address
        assert all(c.address != fake_address for c in caller.routing)
    finally:
        await server.stop(None)
