"""Routing table: k-nearest against brute force, bucket splitting, LRS eviction rules."""

from __future__ import annotations

import os
import random

import pytest

from swarmavg.dht.ids import ID_BITS, distance, id_to_int, int_to_id, key_id
from swarmavg.dht.routing import Contact, RoutingTable


def _contact(peer_id: bytes, port: int = 1) -> Contact:
    return Contact(peer_id, f"127.0.0.1:{port}")


def test_xor_metric() -> None:
    a, b, c = (id_to_int(os.urandom(20)) for _ in range(3))
    assert distance(a, a) == 0
    assert distance(a, b) == distance(b, a)
    assert distance(a, c) <= distance(a, b) + distance(b, c)  # XOR obeys the triangle inequality
    assert int_to_id(a)
    assert id_to_int(int_to_id(a)) == a
    with pytest.raises(ValueError, match="20 bytes"):
        id_to_int(b"short")
    assert key_id(b"x") == key_id(b"x") != key_id(b"y")


@pytest.mark.parametrize(("n", "k"), [(10, 20), (10_000, 20), (10_000, 4)])
def test_nearest_matches_brute_force_over_retained(n: int, k: int) -> None:
    rng = random.Random(n * 31 + k)
    own = rng.randbytes(20)
    table = RoutingTable(own, k=k)
    ids = [rng.randbytes(20) for _ in range(n)]
    for i, peer_id in enumerate(ids):
        lrs = table.add_or_update(_contact(peer_id, i))
        if lrs is not None:  # a full bucket: the paper keeps the old live contact
            assert lrs.peer_id in table
    retained = {c.peer_id for c in table}
    assert len(retained) == len(table)
    if n <= k:
        assert retained == set(ids)
    for _ in range(50):
        target = id_to_int(rng.randbytes(20))
        got = [c.peer_id for c in table.nearest(target, k)]
        brute = sorted(retained, key=lambda p: id_to_int(p) ^ target)[:k]
        assert got == brute


def test_own_neighbourhood_is_complete() -> None:
    """Paper 2.4: a node knows all of its k nearest neighbours (its own bucket keeps splitting)."""
    rng = random.Random(7)
    own = rng.randbytes(20)
    k = 8
    table = RoutingTable(own, k=k)
    ids = [rng.randbytes(20) for _ in range(5000)]
    for peer_id in ids:
        table.add_or_update(_contact(peer_id))
    own_int = id_to_int(own)
    true_nearest = sorted(ids, key=lambda p: id_to_int(p) ^ own_int)[:k]
    assert [c.peer_id for c in table.nearest(own_int, k)] == true_nearest
    # buckets are contiguous and cover the whole keyspace
    assert table.buckets[0].lower == 0
    assert table.buckets[-1].upper == 1 << ID_BITS
    for left, right in zip(table.buckets, table.buckets[1:], strict=False):
        assert left.upper == right.lower
    assert all(len(b.contacts) <= k for b in table.buckets)


def _fill_far_bucket(own: bytes, k: int) -> tuple[RoutingTable, list[bytes]]:
    """A table whose bucket for ids with the opposite top bit (depth 1, 1 % b == 0 with b=1)
    is full and cannot split."""
    table = RoutingTable(own, k=k, b=1)
    top = id_to_int(own) >> (ID_BITS - 1)
    far = []
    rng = random.Random(1)
    while len(far) < k + 3:
        pid = rng.randbytes(20)
        if id_to_int(pid) >> (ID_BITS - 1) != top:
            far.append(pid)
    for pid in far[:k]:
        assert table.add_or_update(_contact(pid)) is None
    return table, far


def test_full_bucket_keeps_old_contacts_until_ping_fails() -> None:
    own = bytes(20)
    k = 3
    table, far = _fill_far_bucket(own, k)
    newcomer = far[k]
    lrs = table.add_or_update(_contact(newcomer))
    assert lrs is not None
    assert lrs.peer_id == far[0]
    assert newcomer not in table  # not inserted: old live contacts are preferred (paper 2.2)
    # the LRS answered the ping: it moves to the tail, the newcomer stays a replacement
    assert table.add_or_update(_contact(far[0])) is None
    second = table.add_or_update(_contact(far[k + 1]))
    assert second is not None
    assert second.peer_id == far[1]
    # this time the ping fails: the LRS is removed and the newest replacement promoted
    assert table.remove(far[1])
    assert far[1] not in table
    assert far[k + 1] in table
    assert len(table) == k
    assert not table.remove(far[1])


def test_self_is_never_added_and_address_updates() -> None:
    own = os.urandom(20)
    table = RoutingTable(own)
    assert table.add_or_update(_contact(own)) is None
    assert len(table) == 0
    peer = os.urandom(20)
    table.add_or_update(_contact(peer, 1))
    table.add_or_update(_contact(peer, 2))
    found = table.get(peer)
    assert found is not None
    assert found.address == "127.0.0.1:2"
    assert len(table) == 1


def test_stale_buckets_and_lookup_marks() -> None:
    table = RoutingTable(os.urandom(20))
    bucket = table.buckets[0]
    assert table.stale_buckets(10.0, now=bucket.last_lookup + 5) == []
    assert table.stale_buckets(10.0, now=bucket.last_lookup + 11) == [bucket]
    table.mark_lookup(123, now=bucket.last_lookup + 11)
    assert table.stale_buckets(10.0, now=bucket.last_lookup + 5) == []


def test_failed_contact_kept_until_stale_unless_replaced() -> None:
    own = bytes(20)
    table = RoutingTable(own, k=3)
    peer = b"\xff" * 20
    table.add_or_update(_contact(peer))
    assert not table.record_failure(peer, stale_after=3)
    assert not table.record_failure(peer, stale_after=3)
    table.add_or_update(_contact(peer))  # it answered again: the count starts over
    assert not table.record_failure(peer, stale_after=3)
    assert not table.record_failure(peer, stale_after=3)
    assert table.record_failure(peer, stale_after=3)
    assert peer not in table
    # with a replacement waiting, one failure is enough (paper 4.1)
    full, far = _fill_far_bucket(own, 3)
    assert full.add_or_update(_contact(far[3])) is not None
    assert full.record_failure(far[0], stale_after=3)
    assert far[3] in full
