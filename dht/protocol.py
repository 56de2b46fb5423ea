"""The DHT wire protocol: inbound handlers (``rpc_*``) and outbound calls (``call_*``).

Both directions keep the routing table current (paper 2.2: every message a node receives or
gets an answer to refreshes the sender's bucket entry):

* A request whose header carries an address (a serving node) teaches us its sender, once the
  header and the sender's signed address check out, and only at an address its connection
  shows it has: the claimed host must be in the address range the request came from (any
  local address from a local source, unless ``limit_local_ranges``). A claim elsewhere (a
  peer behind port forwarding, a relayed peer, a multi-homed host) is checked by a ping to
  the claimed address, and learned from that answer if the claimant answers there
  (:meth:`DHTProtocol.learn_claim`); a claim that is a DNS name is not learned from a request
  at all (anyone can point many names at one host), nor is a local address claimed from a
  public source (it cannot be the sender's own, and is never dialled on its word).
  Client-mode senders send no address and are never learned.
* An answer teaches us the responder at the address we dialled, and only if the answer carries
  the responder's signature binding its id to that very address. Contacts are learned only
  from their owners: a peer that copies another's public key into its answers (the routing
  hijack: a lookup answered with ``(victim id, attacker address)``) is refused,
  and the victim's known address stays. An answer bound to another address than the one we
  dialled is a hint: a ping dials the bound address (bootstrap addresses written differently).
* A failed call counts against a contact only when we dialled the contact's known address, so
  hearsay naming a known id at a dead address cannot get the real contact dropped.

Every request is admitted by token buckets (ratelimit.py): its address range's, from the
connection, before anything else; its sender's, by the verified id, after the signature and
before the nonce is remembered, so that neither a claimed id nor a rate-limited flood touches
what others get. Over either it gets ``RESOURCE_EXHAUSTED``. Records stored for a
peer count against its storage quotas (quotas.py).

Every inbound message is length-checked before it is parsed, and every record is validated
before anything is stored: a bad request gets an error status and changes nothing, not even
the routing table. The service is registered with raw-bytes handlers for exactly that reason.
"""

from __future__ import annotations

import logging
import time
from collections import OrderedDict
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any, NoReturn, TypeVar

import grpc
from google.protobuf.message import DecodeError, Message

from swarmavg.dht.auth import (
    AdmissionError,
    AuthenticationError,
    Authenticator,
    RequestSigner,
    message_digest,
)
from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.config import DHTConfig
from swarmavg.dht.identity import (
    HeaderError,
    Identity,
    address_signature_payload,
    verify_signature,
)
from swarmavg.dht.ids import ID_BYTES, id_to_int, key_id
from swarmavg.dht.quotas import Source
from swarmavg.dht.ranges import (
    RangeRateLimiter,
    grpc_peer_host,
    host_range,
    is_name,
    limited_range,
    split_host,
)
from swarmavg.dht.ratelimit import RateLimiter
from swarmavg.dht.records import StoredRecord
from swarmavg.dht.routing import Contact, RoutingTable
from swarmavg.dht.storage import Storage
from swarmavg.dht.tasks import TaskSet
from swarmavg.dht.validation import (
    SignatureCache,
    ValidationError,
    check_sizes,
    validate_record,
)
from swarmavg.proto import common_pb2, dht_pb2

log = logging.getLogger(__name__)

SERVICE = "swarmavg.v1.DHT"
MAX_ADDRESS_CHARS = 256
_BINDING_CACHE = 4096  # verified (peer id -> address, signature) bindings kept
CLAIM_CHECKS_AT_ONCE = 8
"""Pings to addresses claimed elsewhere than the request came from, in flight at most."""
CLAIM_RETRY_AFTER = 60.0
"""Seconds before the same (peer id, claimed address) is pinged again."""
_CLAIMS_REMEMBERED = 4096

M = TypeVar("M", bound=Message)
R = TypeVar("R", dht_pb2.PingResponse, dht_pb2.StoreResponse, dht_pb2.FindResponse)


class DHTRPCError(Exception):
    """An outbound DHT call failed (unreachable, timed out, error status or a bad answer)."""

    def __init__(self, address: str, reason: str) -> None:
        super().__init__(f"{address}: {reason}")
        self.address = address
        self.reason = reason


class UnboundAnswerError(DHTRPCError):
    """An answer whose responder did not sign a binding of its id to the address we dialled.

    Either a peer answering with another's copied public key (refused), or the right peer
    announcing another address than the one we dialled: then ``bound_address`` is that
    address, which its owner did sign, and is worth dialling instead.
    """

    def __init__(self, address: str, peer_id: bytes, bound_address: str) -> None:
        super().__init__(
            address,
            f"the answer does not prove that peer {peer_id.hex()[:16]} is at this address"
            + (f" (it binds {bound_address})" if bound_address else ""),
        )
        self.peer_id = peer_id
        self.bound_address = bound_address


@dataclass(slots=True)
class FindAnswer:
    """One peer's validated answer for one id: its records and its nearest peers, and what it
    did with the records of this id that the request asked it to store (in order)."""

    records: list[StoredRecord]
    nearest: list[Contact]
    store_statuses: list[dht_pb2.StoreStatus] = field(default_factory=list)


def request_chunks(
    records: Sequence[StoredRecord], max_records: int, max_bytes: int
) -> list[list[StoredRecord]]:
    """Split records into requests of at most ``max_records`` records and ~``max_bytes``."""
    chunks: list[list[StoredRecord]] = [[]]
    size = 0
    for record in records:
        if chunks[-1] and (len(chunks[-1]) >= max_records or size + record.size() > max_bytes):
            chunks.append([])
            size = 0
        chunks[-1].append(record)
        size += record.size()
    return [c for c in chunks if c]


def record_to_proto(record: StoredRecord) -> dht_pb2.Record:
    return dht_pb2.Record(
        key=record.key,
        subkey=record.subkey,
        value=record.value,
        expiration=record.expiration,
        public_key=record.public_key,
        signature=record.signature,
        issued=record.issued,
    )


def record_from_proto(msg: dht_pb2.Record) -> StoredRecord:
    return StoredRecord(
        msg.key, msg.subkey, msg.value, msg.expiration, msg.public_key, msg.signature, msg.issued
    )


class DHTProtocol:
    """Serves the ``DHT`` service and calls it on other nodes.

    Owns the background pings of least-recently-seen contacts (paper 2.2); :meth:`close`
    cancels and awaits them.
    """

    def __init__(
        self,
        identity: Identity,
        config: DHTConfig,
        routing: RoutingTable,
        storage: Storage,
        channels: ChannelPool,
    ) -> None:
        self.identity = identity
        self.config = config
        self.routing = routing
        self.storage = storage
        self.channels = channels
        self.address = ""
        self.signer = RequestSigner(identity, config.run_id, lambda: self.address)
        self.authenticator = Authenticator(
            identity, config.run_id, config.auth_window, config.auth_max_nonces
        )
        self._bindings: OrderedDict[bytes, tuple[str, bytes]] = OrderedDict()
        self._pinging: set[bytes] = set()
        self.rate_limiter = RateLimiter(config.rate_limits)  # per verified peer id
        self.range_limiter = RangeRateLimiter(config.rate_limits)  # per source range, first
        self._claims_tried: OrderedDict[tuple[bytes, str], float] = OrderedDict()
        self._claims_checking: set[bytes] = set()
        self.claims_checked = 0  # pings to claimed addresses that ended (either way)
        self.signatures = SignatureCache(config.signature_cache)
        self.unproven_answers = 0  # answers that did not bind the address we dialled
        self._tasks = TaskSet()
        self._closed = False
        self.rpcs_sent = 0
        self.rpcs_received = 0
        self.set_address("")

    # ---- identity on the wire ----

    def set_address(self, address: str) -> None:
        """Set our public address ("" in client mode) and precompute its address signature.

        Every request and answer is signed at sending time (:mod:`swarmavg.dht.auth`); only
        the timeless address signature is computed once here.
        """
        self.address = address
        self._address_signature = (
            self.identity.sign(
                address_signature_payload(self.config.run_id, self.identity.peer_id, address)
            )
            if address
            else b""
        )

    def validate(self, record: StoredRecord, now: float) -> None:
        """Every check of dht/validation.py under this node's run and key classes.

        Raises:
            ValidationError: with the reason.
        """
        config = self.config
        validate_record(
            record,
            config.limits,
            now,
            config.validators,
            run_id=config.run_id,
            key_classes=config.key_classes,
            signatures=self.signatures,
        )

    # ---- server side ----

    def add_to_server(self, server: grpc.aio.Server) -> None:
        """Register the ``DHT`` service (raw-bytes handlers) on a server not yet started."""
        handlers = {
            "Ping": grpc.unary_unary_rpc_method_handler(self.rpc_ping),
            "Store": grpc.unary_unary_rpc_method_handler(self.rpc_store),
            "Find": grpc.unary_unary_rpc_method_handler(self.rpc_find),
        }
        server.add_generic_rpc_handlers((grpc.method_handlers_generic_handler(SERVICE, handlers),))

    async def _abort(self, context: Any, code: grpc.StatusCode, details: str) -> NoReturn:
        log.debug("rejecting DHT request: %s", details)
        await context.abort(code, details)
        raise AssertionError("unreachable: context.abort raises")  # pragma: no cover

    async def _parse(self, data: bytes, message_type: type[M], context: Any) -> M:
        self.rpcs_received += 1
        if len(data) > self.config.limits.max_request_bytes:
            await self._abort(
                context,
                grpc.StatusCode.RESOURCE_EXHAUSTED,
                f"request of {len(data)} bytes exceeds {self.config.limits.max_request_bytes}",
            )
        try:
            return message_type.FromString(data)
        except DecodeError as e:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"malformed request: {e}")

    def _binds(
        self, header: common_pb2.RequestHeader, peer_id: bytes, address: str, signature: bytes
    ) -> bool:
        """Whether ``signature`` is ``peer_id``'s binding of ``address`` (cached when so)."""
        if self._bindings.get(peer_id) == (address, signature):
            return True
        payload = address_signature_payload(self.config.run_id, peer_id, address)
        if not verify_signature(header.public_key, signature, payload):
            return False
        self._bindings[peer_id] = (address, signature)
        self._bindings.move_to_end(peer_id)
        while len(self._bindings) > _BINDING_CACHE:
            self._bindings.popitem(last=False)
        return True

    def _admit_id(self, peer_id: bytes) -> str | None:
        return self.rate_limiter.admit(peer_id, None)

    async def _check_sender(
        self,
        msg: dht_pb2.PingRequest | dht_pb2.StoreRequest | dht_pb2.FindRequest,
        method: str,
        context: Any,
    ) -> tuple[Source, Contact | None]:
        """Admit the request under its source range's rate, authenticate it, admit it under
        the verified sender's rate; return the sender as a storage-quota source and, for a
        serving sender we may learn at once, its contact (:meth:`learn_claim` may learn it
        later). A bad signature, a replay or a stale or misdirected request: UNAUTHENTICATED;
        over a rate: RESOURCE_EXHAUSTED, and its nonce is not remembered."""
        header, signature = msg.header, msg.address_signature
        source_host = grpc_peer_host(context.peer())
        range_name = (
            limited_range(source_host, self.config.limit_local_ranges) if source_host else None
        )
        refusal = self.range_limiter.admit(range_name)
        if refusal is not None:
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, refusal)
        try:
            peer_id = self.authenticator.check(
                header, _method(method), message_digest(msg), admit=self._admit_id
            )
        except AdmissionError as e:
            await self._abort(context, grpc.StatusCode.RESOURCE_EXHAUSTED, str(e))
        except AuthenticationError as e:
            await self._abort(context, grpc.StatusCode.UNAUTHENTICATED, str(e))
        except HeaderError as e:
            await self._abort(context, grpc.StatusCode.FAILED_PRECONDITION, str(e))
        source = Source(peer_id, range_name)
        address = header.address
        if not address:
            return source, None  # client mode: never enters the routing table
        if len(address) > MAX_ADDRESS_CHARS:
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "address too long")
        if not self._binds(header, peer_id, address, signature):
            await self._abort(
                context,
                grpc.StatusCode.UNAUTHENTICATED,
                "address signature does not verify for this peer id",
            )
        contact = Contact(peer_id, address)
        if not source_host or self._shows(source_host, address):
            return source, contact
        self.learn_claim(contact, source_host)
        return source, None

    def _shows(self, source_host: str, address: str) -> bool:
        """Whether a connection from ``source_host`` shows that its sender is at
        ``address``: the claimed host is an IP in the source's address range, or both are
        local and local ranges are exempt (this host or its LAN)."""
        claimed = split_host(address)
        if is_name(claimed):
            return False
        claimed_range, claimed_local = host_range(claimed)
        source_range, source_local = host_range(source_host)
        if claimed_range == source_range:
            return True
        return claimed_local and source_local and not self.config.limit_local_ranges

    def learn_claim(self, contact: Contact, source_host: str) -> None:
        """A serving sender whose request came from elsewhere than the address it claims:
        learn it only if it answers a ping there (the answer path learns it; see the module
        docstring). A contact already known at that address is refreshed. Never for a DNS
        name (a name is not dialled on a request's word) nor for a local address claimed
        from a public source; at most :data:`CLAIM_CHECKS_AT_ONCE` pings at once and one per
        (id, address) per :data:`CLAIM_RETRY_AFTER` seconds."""
        known = self.routing.get(contact.peer_id)
        if known is not None and known.address == contact.address:
            self.learn(contact)  # that address was proven before
            return
        claimed = split_host(contact.address)
        if is_name(claimed) or (host_range(claimed)[1] and not host_range(source_host)[1]):
            return
        if (
            self._closed
            or contact.peer_id in self._claims_checking
            or len(self._claims_checking) >= CLAIM_CHECKS_AT_ONCE
        ):
            return
        key = (contact.peer_id, contact.address)
        now = time.monotonic()
        tried = self._claims_tried.get(key)
        if tried is not None and now - tried < CLAIM_RETRY_AFTER:
            return
        self._claims_tried[key] = now
        self._claims_tried.move_to_end(key)
        while len(self._claims_tried) > _CLAIMS_REMEMBERED:
            self._claims_tried.popitem(last=False)
        self._claims_checking.add(contact.peer_id)
        self._tasks.spawn(self._check_claim(contact), name="check-claim")

    async def _check_claim(self, contact: Contact) -> None:
        try:
            await self.call_ping(contact.address, expected_id=contact.peer_id)
        except DHTRPCError:
            pass  # not there (or not as that peer): nothing learned
        finally:
            self._claims_checking.discard(contact.peer_id)
            self.claims_checked += 1

    def _answer(self, request: common_pb2.RequestHeader, method: str, answer: R) -> bytes:
        """``answer`` signed for the requester, bound to the request's nonce, with our
        address binding (the caller checks that it covers the address it dialled)."""
        answer.address_signature = self._address_signature
        digest = message_digest(answer, bound_to=request.nonce)
        answer.header.CopyFrom(self.signer.sign_response(request, _method(method), digest))
        return answer.SerializeToString()

    async def rpc_ping(self, request: bytes, context: Any) -> bytes:
        msg = await self._parse(request, dht_pb2.PingRequest, context)
        _, sender = await self._check_sender(msg, "Ping", context)
        if sender is not None:
            self.learn(sender)
        return self._answer(msg.header, "Ping", dht_pb2.PingResponse())

    async def rpc_store(self, request: bytes, context: Any) -> bytes:
        msg = await self._parse(request, dht_pb2.StoreRequest, context)
        source, sender = await self._check_sender(msg, "Store", context)
        limits = self.config.limits
        if len(msg.records) > limits.max_records_per_request:
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(msg.records)} records exceed the cap of {limits.max_records_per_request}",
            )
        now = time.time()
        records = []
        for i, proto in enumerate(msg.records):  # validate all first: all or nothing
            record = record_from_proto(proto)
            try:
                self.validate(record, now)
            except ValidationError as e:
                await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"record {i}: {e}")
            records.append(record)
        statuses = [self.storage.put(r, now, cached=msg.cache, source=source) for r in records]
        if sender is not None:
            self.learn(sender)
        return self._answer(msg.header, "Store", dht_pb2.StoreResponse(statuses=statuses))

    async def rpc_find(self, request: bytes, context: Any) -> bytes:
        msg = await self._parse(request, dht_pb2.FindRequest, context)
        source, sender = await self._check_sender(msg, "Find", context)
        limits = self.config.limits
        if len(msg.key_ids) > limits.max_keys_per_request:
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(msg.key_ids)} ids exceed the cap of {limits.max_keys_per_request}",
            )
        if any(len(kid) != ID_BYTES for kid in msg.key_ids):
            await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, "ids must be 20 bytes")
        k = min(msg.k or self.config.k, limits.max_peers_per_answer)
        now = time.time()
        store_statuses = await self._store_on_find(msg, context, now, source)
        budget = limits.max_response_bytes
        response = dht_pb2.FindResponse()
        for kid in msg.key_ids:
            result = response.results.add()
            if msg.want_values:
                for record in self.storage.get(kid, now):
                    budget -= record.size()
                    if budget < 0:
                        break  # an oversized answer would be refused by the caller's gRPC cap
                    result.records.append(record_to_proto(record))
            for contact in self.routing.nearest(id_to_int(kid), k, exclude=(source.peer_id,)):
                result.nearest.add(peer_id=contact.peer_id, address=contact.address)
        response.store_statuses.extend(store_statuses)
        if sender is not None:
            self.learn(sender)
        return self._answer(msg.header, "Find", response)

    async def _store_on_find(
        self, msg: dht_pb2.FindRequest, context: Any, now: float, source: Source
    ) -> list[dht_pb2.StoreStatus]:
        """Store the records a Find carries, where we are among the nearest to their key.

        A store lookup must query the nodes nearest to the key anyway; carrying the records
        with those queries saves the separate Store round to each of them (about half the
        RPCs of a store). Validation is the same as for Store, all or nothing.
        """
        if not msg.store:
            return []
        limits = self.config.limits
        if len(msg.store) > limits.max_records_per_request:
            await self._abort(
                context,
                grpc.StatusCode.INVALID_ARGUMENT,
                f"{len(msg.store)} records exceed the cap of {limits.max_records_per_request}",
            )
        requested = set(msg.key_ids)
        replication = min(msg.replication or self.config.k, limits.max_peers_per_answer)
        checked = []
        for i, proto in enumerate(msg.store):
            record = record_from_proto(proto)
            try:
                self.validate(record, now)
            except ValidationError as e:
                await self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, f"record {i}: {e}")
            kid = key_id(record.key)
            if kid not in requested:
                await self._abort(
                    context, grpc.StatusCode.INVALID_ARGUMENT, f"record {i} is for an id not asked"
                )
            checked.append((record, kid))
        nearest: dict[bytes, bool] = {}
        statuses = []
        for record, kid in checked:
            if kid not in nearest:
                nearest[kid] = self.among_nearest(kid, replication)
            if nearest[kid]:
                statuses.append(self.storage.put(record, now, key_id_=kid, source=source))
            else:
                statuses.append(dht_pb2.STORE_STATUS_NOT_NEAREST)
        return statuses

    def among_nearest(self, kid: bytes, count: int) -> bool:
        """Whether we are among the ``count`` nodes nearest to ``kid`` that we know of."""
        target = id_to_int(kid)
        nearest = self.routing.nearest(target, count)
        own = self.routing.own_int ^ target
        return len(nearest) < count or own < nearest[-1].id_int ^ target

    # ---- routing-table upkeep ----

    def learn(self, contact: Contact) -> None:
        """Note that ``contact`` is alive; ping the LRS contact of a full bucket (paper 2.2)."""
        lrs = self.routing.add_or_update(contact)
        if lrs is not None and lrs.peer_id not in self._pinging and not self._closed:
            self._pinging.add(lrs.peer_id)
            self._tasks.spawn(self._ping_lrs(lrs), name="ping-lrs")

    async def _ping_lrs(self, contact: Contact) -> None:
        try:
            await self.call_ping(contact.address, expected_id=contact.peer_id)
        except DHTRPCError:
            pass  # call_ping already removed it and promoted a replacement
        finally:
            self._pinging.discard(contact.peer_id)

    def _failed(self, address: str, expected_id: bytes | None, reason: str) -> DHTRPCError:
        if expected_id is not None:
            known = self.routing.get(expected_id)
            if known is None or known.address == address:
                # only a failure at the contact's own address counts against it: hearsay that
                # names a known id at another address cannot get the real contact dropped
                self.routing.record_failure(expected_id, self.config.stale_after)
        return DHTRPCError(address, reason)

    # ---- client side ----

    async def _call(
        self,
        address: str,
        method: str,
        request: dht_pb2.PingRequest | dht_pb2.StoreRequest | dht_pb2.FindRequest,
        answer_type: type[R],
        expected_id: bytes | None,
        timeout: float,
    ) -> tuple[bytes, R]:
        """Sign and send one request; return the responder's id and its authenticated answer.

        Learns the peer, or forgets it when the call fails or the answer does not verify.

        Raises:
            DHTRPCError: no answer, a bad or forged one, or one that does not prove that its
                responder owns the address we dialled (:class:`UnboundAnswerError`).
        """
        if self._closed:
            raise DHTRPCError(address, "node is shut down")
        self.rpcs_sent += 1
        full_method = _method(method)
        request.address_signature = self._address_signature
        header = self.signer.sign(expected_id or b"", full_method, message_digest(request))
        request.header.CopyFrom(header)
        try:
            call = self.channels.channel(address, expected_id).unary_unary(full_method)
            data: bytes = await call(request.SerializeToString(), timeout=timeout)
        except grpc.aio.AioRpcError as e:
            if e.code() == grpc.StatusCode.UNAVAILABLE and address in self.channels:
                channel = self.channels.channel(address, expected_id)
                if channel.get_state() == grpc.ChannelConnectivity.TRANSIENT_FAILURE:
                    # the connection is down: a fresh channel reconnects at once when the peer
                    # comes back, instead of after gRPC's reconnect backoff. Only then, so that
                    # streams of other services on a live channel are never cut.
                    self.channels.discard(address)
            raise self._failed(address, expected_id, f"{e.code().name}: {e.details()}") from None
        except RuntimeError as e:  # the channel pool closed under us during shutdown
            raise self._failed(address, expected_id, str(e)) from None
        try:
            answer = answer_type.FromString(data)
            # A forged answer (another peer's key, a replayed answer to another request) is
            # refused like a failed call: the contact is forgotten, nothing in it is used.
            peer_id = self.authenticator.check_response(
                answer.header,
                full_method,
                message_digest(answer, bound_to=header.nonce),
                expected_id,
            )
        except (DecodeError, HeaderError) as e:
            raise self._failed(address, expected_id, f"bad answer: {e}") from None
        # The responder proved its key; it must also prove that the address we dialled is its
        # own (its timeless address binding), or hearsay could move a known peer's address.
        bound = answer.header.address
        signature = answer.address_signature
        if bound != address or not self._binds(answer.header, peer_id, address, signature):
            self.unproven_answers += 1
            hint = (
                bound
                if bound
                and bound != address
                and len(bound) <= MAX_ADDRESS_CHARS
                and self._binds(answer.header, peer_id, bound, signature)
                else ""
            )
            # not _failed: the contact we know under this id (if any) did not fail
            raise UnboundAnswerError(address, peer_id, hint)
        self.learn(Contact(peer_id, address))
        return peer_id, answer

    async def call_ping(
        self, address: str, expected_id: bytes | None = None, timeout: float | None = None
    ) -> Contact:
        """Ping ``address``; return the responder as a contact.

        An answer bound to another address than ``address`` (an initial peer written as a
        name, or behind a port mapping) is followed once: the bound address is pinged, and
        that contact is returned if it answers as the same peer.

        Raises:
            DHTRPCError: no valid answer within the deadline (the contact is then removed).
        """
        timeout = timeout or self.config.request_timeout
        try:
            peer_id, _ = await self._call(
                address, "Ping", dht_pb2.PingRequest(), dht_pb2.PingResponse, expected_id, timeout
            )
        except UnboundAnswerError as e:
            if not e.bound_address:
                raise
            peer_id, _ = await self._call(
                e.bound_address,
                "Ping",
                dht_pb2.PingRequest(),
                dht_pb2.PingResponse,
                e.peer_id,
                timeout,
            )
            return Contact(peer_id, e.bound_address)
        return Contact(peer_id, address)

    async def call_store(
        self, contact: Contact, records: Sequence[StoredRecord], cache: bool = False
    ) -> list[dht_pb2.StoreStatus]:
        """Store ``records`` on ``contact``; return one ``StoreStatus`` per record.

        Raises:
            DHTRPCError: the call failed or the answer is malformed.
        """
        body = dht_pb2.StoreRequest(records=[record_to_proto(r) for r in records], cache=cache)
        _, answer = await self._call(
            contact.address,
            "Store",
            body,
            dht_pb2.StoreResponse,
            contact.peer_id,
            self.config.request_timeout,
        )
        statuses = list(answer.statuses)
        if len(statuses) != len(records):
            raise self._failed(contact.address, contact.peer_id, "wrong number of statuses")
        return statuses

    async def call_find(
        self,
        contact: Contact,
        key_ids: Sequence[bytes],
        k: int,
        want_values: bool,
        timeout: float | None = None,
        store: Sequence[StoredRecord] = (),
        replication: int = 0,
    ) -> list[FindAnswer]:
        """Ask ``contact`` for its records and nearest peers for each id.

        Records that do not belong to the asked id or fail validation (e.g. forged
        signatures) are dropped, as are malformed peer entries.

        Args:
            store: records (of the asked ids) for the peer to store if it is among the
                ``replication`` nodes nearest to their key; each answer's
                ``store_statuses`` then says what it did with the records of its id.

        Raises:
            DHTRPCError: the call failed or the answer is malformed.
        """
        body = dht_pb2.FindRequest(
            key_ids=key_ids,
            k=k,
            want_values=want_values,
            store=[record_to_proto(r) for r in store],
            replication=replication,
        )
        _, response = await self._call(
            contact.address,
            "Find",
            body,
            dht_pb2.FindResponse,
            contact.peer_id,
            timeout or self.config.request_timeout,
        )
        results = response.results
        if len(results) != len(key_ids) or len(response.store_statuses) != len(store):
            raise self._failed(contact.address, contact.peer_id, "wrong number of results")
        statuses_by_id: dict[bytes, list[dht_pb2.StoreStatus]] = {}
        for record, status in zip(store, response.store_statuses, strict=True):
            statuses_by_id.setdefault(key_id(record.key), []).append(status)
        limits = self.config.limits
        now = time.time()
        answers = []
        for kid, result in zip(key_ids, results, strict=True):
            records = []
            for proto in result.records:
                record = record_from_proto(proto)
                try:
                    check_sizes(record, limits)
                    if key_id(record.key) != kid:
                        raise ValidationError("record for another key")
                    self.validate(record, now)
                except ValidationError as e:
                    log.debug("dropping record from %s: %s", contact.address, e)
                    continue
                records.append(record)
            nearest = []
            for peer in result.nearest[: limits.max_peers_per_answer]:
                if len(peer.peer_id) == ID_BYTES and 0 < len(peer.address) <= MAX_ADDRESS_CHARS:
                    nearest.append(Contact(peer.peer_id, peer.address))
            answers.append(FindAnswer(records, nearest, statuses_by_id.get(kid, [])))
        return answers

    async def close(self) -> None:
        """Stop pinging; cancel and await the background pings. Idempotent."""
        self._closed = True
        await self._tasks.close()


def _method(name: str) -> str:
    """The full gRPC method name of DHT method ``name`` (what signatures cover)."""
    return f"/{SERVICE}/{name}"
