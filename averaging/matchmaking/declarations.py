"""Matchmaking declarations and the pure rules of who leads whom (no I/O here).

A peer looking for a group declares itself in the DHT under the round's matchmaking key
``{run}.{key}.0b{group-bits}`` (a dictionary value: one subkey per declarer, the peer id in
hex) with an expiration at the moment it gives up. The declaration says when the peer
started looking, where it listens, what it brings (mode, bandwidth, schema hash) and its
group size.

Who leads is ranked by a hash of the round's key and the declarer's peer id
(:func:`leader_order`), a value no declarer sets: every peer reads the same declarations,
so every peer computes the same order and asks the same leader, and one identity leads
its fair share of rounds (each round key deals a new order), not every round. The order
once went by the declared start, which the declarer writes itself: a start just inside the
accepted window led every round.

Deadlock freedom: a leader accepts only followers that come *after* it in this order (or
that cannot lead at all: client-mode peers, or that it shuns: it will not follow them, and
never asks them), and answers a JoinGroup from its local state without waiting on any
call of its own. The order of two peers depends on their two ids and the key alone, so
both compute it alike: two peers that ask each other at once cannot both wait, one of
them answers ``JOIN_REJECT_NOT_LEADER`` immediately.
"""

from __future__ import annotations

import hashlib
import math
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from typing import Any

from swarmavg.averaging.aggregation import MAX_AGGREGATION_CHARS, MEAN, canonical_aggregation
from swarmavg.averaging.group import MAX_GROUP_SIZE, GroupInfo, Member, Mode
from swarmavg.averaging.matchmaking.group_ranges import (
    crowded_range,
    max_members_per_range,
    public_range_of_address,
)
from swarmavg.dht.records import owner_suffix, subkey_owner
from swarmavg.proto import averaging_pb2

DECLARATION_VERSION = 1
SCHEMA_HASH_BYTES = 32
MAX_ADDRESS_CHARS = 256
MAX_USER_DATA_BYTES = 64 * 1024
MAX_CODEC_CHARS = 64
MAX_KEY_CHARS = 512
USER_DATA_DIGEST_BYTES = 16
_MODE_VALUES = frozenset(int(m) for m in Mode)  # the modes a peer may send
DEFAULT_START_WINDOW = (600.0, 30.0)
"""How far a declared ``start`` may lie before and after now (seconds) for the declaration
to count: a start says how long a peer has looked (its give-up time is checked against
it), and one far outside what any call waits through is not an honest peer's. 600 s covers
the longest matchmaking a peer waits through; 30 s covers clock skew between honest peers."""
_RANK_DOMAIN = b"swarmavg.leader-rank.v1"


def leader_order(key: str, peer_id: bytes) -> tuple[bytes, bytes]:
    """Sort key of leadership under round key ``key``: the smaller first.

    A hash of the key and the peer id: the declarer chooses neither (the key is the
    round's, the id is its public key's), so no value it writes wins it every round, and
    each round key deals a fresh order, so one identity leads about one round in n of a
    swarm of n. The peer id breaks (never seen) hash ties.
    """
    digest = hashlib.sha256(_RANK_DOMAIN + key.encode() + b"\0" + peer_id).digest()
    return (digest, peer_id)


@dataclass(frozen=True)
class Declaration:
    """One peer's matchmaking declaration, as stored in (and read back from) the DHT.

    Attributes:
        peer_id: the declarer's 20-byte id.
        address: ``HOST:PORT`` of its Averaging service; empty when it cannot be dialled.
        start: unix time at which it started looking; the earliest start leads.
        deadline: unix time at which, as a leader, it closes a group that is not full.
        give_up: unix time at which it stops matchmaking (also the DHT expiration).
        mode: its averaging mode.
        bandwidth: its reported bandwidth.
        schema_hash: digest of its tensors' shapes and dtypes.
        group_size: the group size it asks for (as a leader, the cap it enforces).
        aggregation: the canonical aggregation rule it averages with; peers of different
            rules never group (a robust member must not end up in a mean group).
        codec: the codec it averages with; a follower only takes a group of its codec.
        data_port: its data-plane port (0: none); members stream only to signed ports.
        user_data_digest: :func:`user_data_digest` of the user data it joins with.
        key: the round key it was declared under (not encoded: the DHT key carries it);
            with the peer id it ranks the declarer for leadership.
        signs_answers: it signs its ``JoinGroup`` answers (``answers``): a follower takes
            no unsigned answer from it (one stripped on the path).
    """

    peer_id: bytes
    address: str
    start: float
    deadline: float
    give_up: float
    mode: Mode
    bandwidth: float
    schema_hash: bytes
    group_size: int
    aggregation: str = MEAN
    codec: str = ""
    data_port: int = 0
    user_data_digest: bytes = b""
    key: str = ""
    signs_answers: bool = False

    @property
    def order(self) -> tuple[bytes, bytes]:
        """Sort key of leadership under its key (:func:`leader_order`)."""
        return leader_order(self.key, self.peer_id)

    @property
    def can_lead(self) -> bool:
        """Whether others can dial this peer to join it (client-mode peers cannot lead)."""
        return self.mode is not Mode.CLIENT and bool(self.address)

    def encode(self) -> dict[str, Any]:
        """The msgpack-able DHT value (the subkey carries the peer id)."""
        return {
            "v": DECLARATION_VERSION,
            "addr": self.address,
            "start": self.start,
            "deadline": self.deadline,
            "give_up": self.give_up,
            "mode": int(self.mode),
            "bw": self.bandwidth,
            "schema": self.schema_hash,
            "gs": self.group_size,
            "agg": self.aggregation,
            "codec": self.codec,
            "dp": self.data_port,
            "ud": self.user_data_digest,
            "sa": self.signs_answers,
        }

    def within_window(self, now: float, window: tuple[float, float] = DEFAULT_START_WINDOW) -> bool:
        """Whether the declared start lies in ``[now - window[0], now + window[1]]``."""
        before, after = window
        return now - before <= self.start <= now + after


def user_data_digest(user_data: bytes) -> bytes:
    """What a declaration signs of the user data (the data itself may be 64 KiB)."""
    return hashlib.sha256(b"swarmavg.user-data.v1" + user_data).digest()[:USER_DATA_DIGEST_BYTES]


def _finite(value: object) -> float | None:
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    result = float(value)
    return result if math.isfinite(result) else None


def declaration_subkey(peer_id: bytes) -> str:
    """The subkey a peer declares under: owned (signed) by it, so no one else can forge or
    overwrite its declaration (the DHT checks owner signatures, see dht/validation.py)."""
    return owner_suffix(peer_id)


def decode_declaration(subkey: object, value: object, key: str = "") -> Declaration | None:
    """Parse one DHT entry; ``None`` for anything malformed (peers are untrusted).

    Args:
        subkey: the dictionary subkey, ``[owner:<declarer's peer id hex>]``.
        value: the stored value.
        key: the round key it was read under.
    """
    peer_id = subkey_owner(subkey)
    if peer_id is None:
        return None
    if not isinstance(value, Mapping) or value.get("v") != DECLARATION_VERSION:
        return None
    address = value.get("addr")
    schema = value.get("schema")
    group_size = value.get("gs")
    mode = value.get("mode")
    aggregation = _aggregation_or_none(value.get("agg", MEAN))
    start, deadline, give_up, bandwidth = (
        _finite(value.get(k)) for k in ("start", "deadline", "give_up", "bw")
    )
    codec = value.get("codec", "")
    data_port = value.get("dp", 0)
    digest = value.get("ud", b"")
    signs_answers = value.get("sa", False)
    if (
        not isinstance(address, str)
        or len(address) > MAX_ADDRESS_CHARS
        or not isinstance(schema, bytes)
        or len(schema) != SCHEMA_HASH_BYTES
        or not isinstance(group_size, int)
        or isinstance(group_size, bool)
        or group_size < 1
        or not isinstance(mode, int)
        or mode not in _MODE_VALUES
        or start is None
        or deadline is None
        or give_up is None
        or bandwidth is None
        or bandwidth < 0
        or not start <= deadline <= give_up
        or aggregation is None
        or not isinstance(codec, str)
        or len(codec) > MAX_CODEC_CHARS
        or not isinstance(data_port, int)
        or isinstance(data_port, bool)
        or not 0 <= data_port <= 65535
        or not isinstance(digest, bytes)
        or len(digest) not in (0, USER_DATA_DIGEST_BYTES)
        or not isinstance(signs_answers, bool)
    ):
        return None
    return Declaration(
        peer_id=peer_id,
        address=address,
        start=start,
        deadline=deadline,
        give_up=give_up,
        mode=Mode(mode),
        bandwidth=bandwidth,
        schema_hash=schema,
        group_size=group_size,
        aggregation=aggregation,
        codec=codec,
        data_port=data_port,
        user_data_digest=digest,
        key=key,
        signs_answers=signs_answers,
    )


def _aggregation_or_none(value: object) -> str | None:
    """A peer's aggregation field; ``None`` when it names no rule in canonical form.

    Peers send the canonical spelling, with every parameter explicit. Another spelling is
    not taken as the rule it would parse to: a name from another version lacks the
    parameters this one added (``centered-clip`` without ``reject``), and filling in
    today's defaults would put peers that mean different rules in one group.
    """
    if not isinstance(value, str) or len(value) > MAX_AGGREGATION_CHARS:
        return None
    spec = value or MEAN
    if spec == MEAN:  # nearly every peer's: no parse
        return MEAN
    try:
        rule = canonical_aggregation(spec)
    except ValueError:
        return None
    return rule if rule == spec else None


def requested_aggregation(request: averaging_pb2.JoinRequest) -> str:
    """The canonical rule a would-be follower averages with (empty: ``mean``).

    Raises:
        ValueError: it names no rule (the leader answers ``JOIN_REJECT_BAD_REQUEST``).
    """
    rule = _aggregation_or_none(request.aggregation)
    if rule is None:
        raise ValueError(
            f"unknown aggregation {request.aggregation[:MAX_AGGREGATION_CHARS]!r} "
            "(not a rule's canonical name: another version's peer?)"
        )
    return rule


def leader_candidates(
    declarations: Iterable[Declaration],
    me: Declaration,
    now: float,
    excluded: set[bytes] | frozenset[bytes] = frozenset(),
) -> list[Declaration]:
    """Peers that ``me`` should ask to lead it, best first.

    A candidate comes before ``me`` in leader order, can be dialled, has not given up, has
    the same schema hash, codec and aggregation rule, and is not in ``excluded``. A
    client-mode ``me`` cannot lead, so for it every dialable peer qualifies, whatever its start.
    """
    result = [
        d
        for d in declarations
        if d.peer_id != me.peer_id
        and d.peer_id not in excluded
        and d.can_lead
        and d.give_up > now
        and d.schema_hash == me.schema_hash
        and d.aggregation == me.aggregation
        and d.codec == me.codec
        and (d.order < me.order or not me.can_lead)
    ]
    result.sort(key=lambda d: d.order)
    return result


def mismatched_schemas(declarations: Iterable[Declaration], me: Declaration) -> list[Declaration]:
    """Live declarations under the same key whose schema hash differs from ``me``'s."""
    return [d for d in declarations if d.peer_id != me.peer_id and d.schema_hash != me.schema_hash]


@dataclass(frozen=True)
class JoinState:
    """What a leader knows when a join request arrives (a snapshot of its round)."""

    me: Declaration
    following: bool
    closed: bool
    num_members: int
    """Members so far, the leader included."""
    group_size: int
    shunned: frozenset[bytes] = frozenset()
    """Peers that rank before this leader but that it will not follow this round (a
    leader that stalled it, one that refused it): it leads them when they ask."""


def decide_join(
    state: JoinState,
    follower_order: tuple[bytes, bytes],
    follower_can_lead: bool,
    schema: bytes,
    aggregation: str = MEAN,
) -> averaging_pb2.JoinCode:
    """The leader's answer to a join request; a ``JoinCode`` value.

    Args:
        follower_order: the follower's :func:`leader_order` under the leader's key.

    Returns ``JOIN_ACCEPTED`` when the follower may join now; otherwise the final code to
    send (``JOIN_REDIRECT`` means: tell it to ask my own leader).
    """
    codes = averaging_pb2
    if state.closed:
        return codes.JOIN_REJECT_FULL
    if state.following:
        return codes.JOIN_REDIRECT
    if schema != state.me.schema_hash:
        return codes.JOIN_REJECT_SCHEMA_MISMATCH
    if aggregation != state.me.aggregation:
        return codes.JOIN_REJECT_AGGREGATION_MISMATCH
    if (
        follower_can_lead
        and follower_order < state.me.order
        and follower_order[1] not in state.shunned
    ):
        return codes.JOIN_REJECT_NOT_LEADER
    if not state.me.can_lead:
        return codes.JOIN_REJECT_NOT_LEADER
    if state.num_members >= state.group_size:
        return codes.JOIN_REJECT_FULL
    return codes.JOIN_ACCEPTED


def group_to_proto(group: GroupInfo) -> averaging_pb2.GroupDescription:
    """Wire form of a formed group."""
    return averaging_pb2.GroupDescription(
        group_id=group.group_id,
        members=[
            averaging_pb2.GroupMember(
                peer_id=m.peer_id,
                address=m.address or "",
                mode=int(m.mode),
                bandwidth=m.bandwidth,
                user_data=m.user_data,
                data_port=m.data_port,
            )
            for m in group.members
        ],
        schema_hash=group.schema_hash,
        codec=group.codec,
        aggregation=group.aggregation,
    )


def group_from_proto(message: averaging_pb2.GroupDescription) -> GroupInfo:
    """Parse and validate a group received from a leader.

    Raises:
        ValueError: the description is malformed (unknown mode, oversized field, bad ids,
            duplicate members, no reducer, ...).
    """
    if len(message.schema_hash) != SCHEMA_HASH_BYTES:
        raise ValueError("schema hash must be 32 bytes")
    if not message.codec or len(message.codec) > MAX_CODEC_CHARS:
        raise ValueError("codec name missing or too long")
    if len(message.aggregation) > MAX_AGGREGATION_CHARS:
        raise ValueError("aggregation name too long")
    members = []
    for m in message.members:
        if m.mode not in _MODE_VALUES:
            raise ValueError(f"unknown mode {m.mode}")
        if len(m.address) > MAX_ADDRESS_CHARS or len(m.user_data) > MAX_USER_DATA_BYTES:
            raise ValueError("member address or user data too long")
        members.append(
            Member(
                peer_id=bytes(m.peer_id),
                address=m.address or None,
                mode=Mode(m.mode),
                bandwidth=float(m.bandwidth),
                user_data=bytes(m.user_data),
                data_port=m.data_port,  # Member checks the range
            )
        )
    return GroupInfo(
        group_id=bytes(message.group_id),
        members=tuple(members),
        schema_hash=bytes(message.schema_hash),
        codec=message.codec,
        aggregation=message.aggregation or MEAN,  # GroupInfo checks it is canonical
    )


def member_from_join_request(peer_id: bytes, request: averaging_pb2.JoinRequest) -> Member:
    """Validate a would-be follower's request; the member it would be in the group.

    Raises:
        ValueError: any field out of range (the leader answers ``JOIN_REJECT_BAD_REQUEST``).
    """
    if not 0 < len(request.key) <= MAX_KEY_CHARS:
        raise ValueError("key missing or too long")
    if len(request.schema_hash) != SCHEMA_HASH_BYTES:
        raise ValueError("schema hash must be 32 bytes")
    if len(request.user_data) > MAX_USER_DATA_BYTES:
        raise ValueError("user data too long")
    if request.mode not in _MODE_VALUES:
        raise ValueError(f"unknown mode {request.mode}")
    if not math.isfinite(request.declared_start):
        raise ValueError("declared start must be finite")
    address = request.header.address
    if len(address) > MAX_ADDRESS_CHARS:
        raise ValueError("address too long")
    mode = Mode(request.mode)
    return Member(  # Member checks the bandwidth (finite, >= 0) and the address
        peer_id=peer_id,
        address=(address or None) if mode is not Mode.CLIENT else None,
        mode=mode,
        bandwidth=float(request.bandwidth),
        user_data=bytes(request.user_data),
        data_port=request.data_port if mode is not Mode.CLIENT else 0,
    )


def declaration_from_join_request(
    member: Member, request: averaging_pb2.JoinRequest
) -> Declaration | None:
    """The declaration a verified join request from ``member`` stands for: the request
    repeats every field its sender declares, under its own signature, so the leader and
    the members check the sender's entry against it without reading the DHT. ``None``
    when it carries none (an older peer: give-up 0) or a field is out of range."""
    start, deadline, give_up = (
        _finite(v) for v in (request.declared_start, request.deadline, request.give_up)
    )
    aggregation = _aggregation_or_none(request.aggregation)
    if (
        start is None
        or deadline is None
        or give_up is None
        or not 0 < start <= deadline <= give_up
        or not 0 < request.group_size <= MAX_GROUP_SIZE
        or not 0 < len(request.codec) <= MAX_CODEC_CHARS
        or aggregation is None
        or len(request.schema_hash) != SCHEMA_HASH_BYTES
        or not 0 < len(request.key) <= MAX_KEY_CHARS
    ):
        return None
    return Declaration(
        **_member_fields(member),
        start=start,
        deadline=deadline,
        give_up=give_up,
        schema_hash=bytes(request.schema_hash),
        group_size=request.group_size,
        aggregation=aggregation,
        codec=request.codec,
        key=request.key,
        signs_answers=request.signed_answers,
    )


def leader_entry_declaration(member: Member, key: str, now: float) -> Declaration:
    """What a leader's entry in a group it signed says of it: its own word, as its
    declaration is, for the checks of the fields a member signs
    (:func:`declaration_mismatch`); the times are ``now`` (they are not checked)."""
    return Declaration(
        **_member_fields(member),
        start=now,
        deadline=now,
        give_up=now,
        schema_hash=bytes(SCHEMA_HASH_BYTES),
        group_size=1,
        key=key,
    )


def _member_fields(member: Member) -> dict[str, Any]:
    """The declaration's fields a group member's entry gives (those
    :func:`declaration_mismatch` compares)."""
    return {
        "peer_id": member.peer_id,
        "address": member.address or "",
        "mode": member.mode,
        "bandwidth": member.bandwidth,
        "data_port": member.data_port,
        "user_data_digest": user_data_digest(member.user_data),
    }


def declaration_mismatch(member: Member, declaration: Declaration | None) -> str | None:
    """Why ``member`` (as a leader or a join request describes it) is not what its owner
    signed in ``declaration``; ``None`` when every field it signs agrees.

    The declaration is an owner-signed DHT record (see ``averaging/protocol_keys.py``), so
    its address, data port, mode, bandwidth and user data digest are the member's own word;
    a ``JoinRequest``'s or a leader's copy of them is not (an unsigned address made every
    member stream its part at any ``host:port``).
    """
    if declaration is None:
        return "no signed declaration of it is visible"
    if declaration.peer_id != member.peer_id:
        return "the declaration is another peer's"
    if member.mode is not declaration.mode:
        return f"mode {member.mode.name} differs from its signed {declaration.mode.name}"
    if (member.address or "") != declaration.address:
        return f"address {member.address!r} differs from its signed {declaration.address!r}"
    if member.data_port != declaration.data_port:
        return f"data port {member.data_port} differs from its signed {declaration.data_port}"
    if member.bandwidth != declaration.bandwidth:
        return f"bandwidth {member.bandwidth} differs from its signed {declaration.bandwidth}"
    if user_data_digest(member.user_data) != declaration.user_data_digest:
        return "user data differs from what it signed"
    return None


@dataclass(frozen=True)
class FollowerAsk:
    """What a follower asked for, against which it checks the group its leader formed."""

    peer_id: bytes
    address: str | None
    mode: Mode
    bandwidth: float
    user_data: bytes
    data_port: int
    schema_hash: bytes
    codec: str
    min_group_size: int
    group_size: int
    aggregation: str = MEAN


def check_formed_group(
    message: averaging_pb2.GroupDescription,
    ask: FollowerAsk,
    leader_id: bytes,
    declarations: Mapping[bytes, Declaration],
) -> GroupInfo:
    """Parse the group a leader sent and check it is the one we asked for.

    The leader decides, the follower checks: the group must have our schema and codec, a
    size within our bounds, our own entry exactly as we asked, only members whose
    entries match the declarations they signed (``declarations``: the live ones we read,
    by peer id), so we stream only to addresses their owners signed, and no more members
    signing addresses in one public range than ``group_ranges`` allows (a leader filling
    the group with its own identities).

    Raises:
        ValueError: malformed, or any of the above differs; the message says what.
    """
    group = group_from_proto(message)
    index = group.index_of(ask.peer_id)
    if index is None or group.index_of(leader_id) is None:
        raise ValueError("the group lacks this peer or its leader")
    if group.schema_hash != ask.schema_hash:
        raise ValueError("the group has another schema hash")
    if group.aggregation != ask.aggregation:
        raise ValueError(
            f"the group runs aggregation {group.aggregation!r}, "
            f"this peer asked for {ask.aggregation!r}"
        )
    if group.codec != ask.codec:
        raise ValueError(f"the group uses codec {group.codec!r}, this peer asked for {ask.codec!r}")
    if not ask.min_group_size <= group.size <= ask.group_size:
        raise ValueError(
            f"the group has {group.size} members, this peer asked for "
            f"{ask.min_group_size}..{ask.group_size}"
        )
    mine = group.members[index]
    wanted = Member(
        peer_id=ask.peer_id,
        address=ask.address if ask.mode is not Mode.CLIENT else None,
        mode=ask.mode,
        bandwidth=ask.bandwidth,
        user_data=ask.user_data,
        data_port=ask.data_port if ask.mode is not Mode.CLIENT else 0,
    )
    if mine != wanted:
        raise ValueError("the leader altered this peer's member entry")
    for member in group.members:
        if member.peer_id == ask.peer_id:
            continue
        reason = declaration_mismatch(member, declarations.get(member.peer_id))
        if reason is not None:
            raise ValueError(f"member {member.peer_id.hex()[:12]}: {reason}")
    crowded = crowded_range(
        ([public_range_of_address(m.address)] for m in group.members), ask.group_size
    )
    if crowded is not None:
        raise ValueError(
            f"{crowded[1]} members sign addresses in one range {crowded[0]}, more than "
            f"the {max_members_per_range(ask.group_size)} one range may hold"
        )
    return group
