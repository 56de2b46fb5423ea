"""Units of the per-source limits: token buckets, the storage ledger, the signature cache."""

from __future__ import annotations

import time

from swarmavg.dht import Identity
from swarmavg.dht.identity import address_signature_payload
from swarmavg.dht.quotas import Source, StorageQuotas
from swarmavg.dht.ratelimit import RateLimiter, RateLimits
from swarmavg.dht.records import StoredRecord, pack, pack_subkey
from swarmavg.dht.storage import FULL, STORED, Storage
from swarmavg.dht.validation import SignatureCache

RUN = "test"


def test_token_bucket_by_id_and_by_range() -> None:
    now = [0.0]
    limiter = RateLimiter(
        RateLimits(per_source_rate=1, per_source_burst=2, per_range_factor=3), clock=lambda: now[0]
    )
    a, *others = (bytes([i]) * 20 for i in range(5))
    assert limiter.admit(a, None) is None
    assert limiter.admit(a, None) is None
    assert "peer" in (limiter.admit(a, None) or "")  # burst spent
    now[0] = 1.0
    assert limiter.admit(a, None) is None  # one token back after a second
    # four ids from one range, each within its own burst of 2, share the range's 6 tokens
    admitted = [limiter.admit(p, "1.2.3.0/24") is None for p in others for _ in range(2)]
    assert admitted.count(True) == 6
    assert "address range 1.2.3.0/24" in (limiter.admit(others[0], "1.2.3.0/24") or "")


def test_storage_quota_follows_replacements_and_expiry() -> None:
    storage = Storage(max_bytes=1 << 20)
    alice, bob = Source(b"a" * 20), Source(b"b" * 20)
    now = time.time()
    first = StoredRecord(b"k", pack_subkey("s"), pack("v1"), now + 10)
    assert storage.put(first, now, source=alice) == STORED
    newer = StoredRecord(b"k", pack_subkey("s"), pack("v2"), now + 20)
    assert storage.put(newer, now, source=bob) == STORED
    assert storage.ledger.usage(alice.peer_id) == (0, 0)
    assert storage.ledger.usage(bob.peer_id) == (newer.size(), 1)
    storage.sweep(now + 30)
    assert storage.ledger.usage(bob.peer_id) == (0, 0)


def test_signature_cache_never_vouches_for_another_payload() -> None:
    identity = Identity.generate()
    cache = SignatureCache(size=4)
    signature = identity.sign(b"payload")
    assert cache.verify(identity.public_key, signature, b"payload")
    assert cache.verify(identity.public_key, signature, b"payload")
    assert cache.hits == 1
    assert not cache.verify(identity.public_key, signature, b"other payload")
    assert not cache.verify(Identity.generate().public_key, signature, b"payload")
    payload = address_signature_payload(RUN, identity.peer_id, "x:1")
    assert cache.verify(identity.public_key, identity.sign(payload), payload)


def test_a_signature_made_here_is_remembered_without_verifying_and_vouches_for_nothing_else() -> (
    None
):
    identity = Identity.generate()
    cache = SignatureCache(size=4)
    signature = identity.sign(b"payload")
    cache.remember_own(identity.public_key, signature, b"payload")
    assert cache.verify(identity.public_key, signature, b"payload")
    assert (cache.hits, cache.misses) == (1, 0)
    assert not cache.verify(identity.public_key, signature, b"other payload")
    assert not cache.verify(identity.public_key, bytes(64), b"payload")
    assert SignatureCache(size=0).remember_own(identity.public_key, signature, b"x") is None


def test_subkeys_per_source_and_per_range() -> None:
    storage = Storage(quotas=StorageQuotas(max_subkeys_per_source=3, per_range_factor=2))
    now = time.time()

    def put(source: Source, n: int) -> list[int]:
        return [
            storage.put(
                StoredRecord(b"k", pack_subkey(f"{source.peer_id.hex()}-{i}"), pack(i), now + 60),
                now,
                source=source,
            )
            for i in range(n)
        ]

    assert put(Source(b"a" * 20), 4) == [STORED] * 3 + [FULL]
    assert "subkeys of this key" in storage.last_refusal
    # a range holds twice what one id does, whichever ids it uses
    assert put(Source(b"b" * 20, "1.2.3.0/24"), 3) == [STORED] * 3
    assert put(Source(b"c" * 20, "1.2.3.0/24"), 3) == [STORED] * 3
    assert put(Source(b"d" * 20, "1.2.3.0/24"), 1) == [FULL]
    assert "address range 1.2.3.0/24" in storage.last_refusal
    assert put(Source(b"e" * 20, "5.6.7.0/24"), 1) == [STORED]
