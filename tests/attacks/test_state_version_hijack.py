"""State hijack by a claimed version (critical).

A state advertisement's ``version`` is whatever its donor says, any finite float, and
joiners used to take the highest: one advert with ``version=1e300`` made every joiner and
every catch-up load the attacker's tensors. Now a joiner takes the root held by the most
distinct donors, and a version counts only as far as another donor vouches for it
(averaging/state/adverts.py, ``choose_donors``).

Over real DHT nodes and gRPC on 127.0.0.1: honest donors publish one state (byte-identical
after a round, so one root), an attacker publishes forged tensors under a huge version.
Then the pure rule, for the cases a swarm on one machine cannot stage cheaply.
"""

from __future__ import annotations

import random

import numpy as np
import pytest

from swarmavg.averaging.state.adverts import Advertisement, choose_donors
from swarmavg.averaging.state.config import StateSharingConfig
from tests.averaging.averager_swarm import AveragerSwarm, Peer, fast_config

CHUNK = 4096
CONFIG = fast_config(state=StateSharingConfig(chunk_size=CHUNK, batch_chunks=4))
HUGE = 1e300


def honest_state() -> list[np.ndarray]:
    rng = np.random.default_rng(0)
    return [rng.standard_normal((64, 100)).astype(np.float32), np.arange(7, dtype=np.int64)]


def forged_state() -> list[np.ndarray]:
    """The same layout (so a wrapper would take it), the attacker's values."""
    return [np.full((64, 100), 1e6, dtype=np.float32), np.zeros(7, dtype=np.int64)]


def same(a: list[np.ndarray], b: list[np.ndarray]) -> bool:
    return len(a) == len(b) and all(x.tobytes() == y.tobytes() for x, y in zip(a, b, strict=True))


async def loads(joiner: Peer) -> tuple[bytes, list[np.ndarray]]:
    return await joiner.averager.load_state(timeout=30)


@pytest.mark.timeout(120)
async def test_one_advert_with_a_huge_version_does_not_hijack_joiners() -> None:
    swarm = AveragerSwarm()
    try:
        honest = [await swarm.add(CONFIG) for _ in range(2)]
        attacker = await swarm.add(CONFIG)
        catching_up, newcomer = await swarm.add(CONFIG), await swarm.add(CONFIG)
        for donor in honest:  # the state after a round: the same bytes, one root
            await donor.averager.publish_state(honest_state(), b"epoch=7")

        # control: no attacker yet, the joiner takes the honest state
        metadata, tensors = await loads(catching_up)
        assert (metadata, same(tensors, honest_state())) == (b"epoch=7", True)

        # the attack: one identity, its own root, version 1e300
        await attacker.averager.publish_state(forged_state(), b"epoch=999999", version=HUGE)
        for joiner in (catching_up, newcomer):  # a catch-up (holds the state) and a newcomer
            metadata, tensors = await loads(joiner)
            assert metadata == b"epoch=7", "a joiner loaded the attacker's state"
            assert same(tensors, honest_state())
        assert attacker.averager.state_sharer.served_chunks == 0

        # control of the attack itself: the forged advert is well formed and its donor
        # serves it, so with the honest donors gone it is what a joiner gets (their
        # adverts outlive them: the joiner fails over to the only state left)
        for donor in honest:
            await donor.stop()
        metadata, tensors = await loads(newcomer)
        assert (metadata, same(tensors, forged_state())) == (b"epoch=999999", True)
    finally:
        await swarm.close()


@pytest.mark.timeout(120)
async def test_two_identities_on_a_forged_root_lose_to_three_honest_donors() -> None:
    swarm = AveragerSwarm()
    try:
        honest = [await swarm.add(CONFIG) for _ in range(3)]
        attackers = [await swarm.add(CONFIG) for _ in range(2)]
        joiner = await swarm.add(CONFIG)
        for donor in honest:
            await donor.averager.publish_state(honest_state(), b"epoch=7")
        for attacker in attackers:  # two identities vouch for each other's version
            await attacker.averager.publish_state(forged_state(), b"epoch=999999", version=HUGE)
        metadata, tensors = await loads(joiner)
        assert (metadata, same(tensors, honest_state())) == (b"epoch=7", True)
        assert sum(a.averager.state_sharer.served_chunks for a in attackers) == 0
    finally:
        await swarm.close()


# ---------------------------------------------------------------------- the rule itself


def ad(owner: int, root: int, version: float) -> Advertisement:
    return Advertisement(bytes([owner]) * 20, f"10.0.0.{owner}:1", bytes([root]) * 32, version, 1)


def first_root(ads: list[Advertisement], seed: int) -> bytes:
    return choose_donors(ads, exclude=b"me", rng=random.Random(seed))[0][0].root


@pytest.mark.timeout(30)
def test_a_version_buys_nothing_beyond_what_another_donor_claims() -> None:
    """Every donor holds a state of its own (DiLoCo): one identity is indistinguishable
    from an honest donor. Its version then makes no difference at all: 1e300 ranks
    exactly like the freshest honest version, and a coin decides between them."""
    honest = [ad(1, 1, 100.0), ad(2, 2, 90.0)]
    for seed in range(50):
        huge = first_root([*honest, ad(9, 9, HUGE)], seed)
        equal = first_root([*honest, ad(9, 9, 100.0)], seed)
        assert huge == equal
    firsts = {first_root([*honest, ad(9, 9, HUGE)], seed) for seed in range(50)}
    assert firsts == {bytes([1]) * 32, bytes([9]) * 32}  # never the stale 90.0, never forced


@pytest.mark.timeout(30)
def test_the_root_most_donors_hold_wins_until_an_attacker_matches_their_number() -> None:
    honest = [ad(1, 1, 100.0), ad(2, 1, 101.0), ad(3, 1, 102.0)]
    for n in (1, 2):
        forged = [ad(10 + i, 9, HUGE) for i in range(n)]
        assert all(first_root([*honest, *forged], s) == bytes([1]) * 32 for s in range(20))
    # the documented bound: as many identities as the honest root has donors, vouching
    # for each other's version, win
    forged = [ad(10 + i, 9, HUGE) for i in range(3)]
    assert first_root([*honest, *forged], 0) == bytes([9]) * 32


@pytest.mark.timeout(30)
def test_an_identity_cannot_lift_an_old_honest_root_with_its_version() -> None:
    """Rollback: an attacker re-advertises the previous honest state with version 1e300.
    At equal support the old root's freshness is what its own honest donor claims."""
    ads = [ad(1, 1, 100.0), ad(2, 2, 200.0), ad(3, 2, 201.0), ad(9, 1, HUGE)]
    assert all(first_root(ads, s) == bytes([2]) * 32 for s in range(20))


@pytest.mark.timeout(30)
def test_an_owner_advertising_twice_counts_for_neither() -> None:
    twice = [ad(9, 9, HUGE), ad(9, 9, HUGE)]  # e.g. a str and a bytes subkey
    ads = [ad(1, 1, 100.0), *twice]
    groups = choose_donors(ads, exclude=b"me", rng=random.Random(0))
    assert [[a.peer_id for a in g] for g in groups] == [[bytes([1]) * 20]]


@pytest.mark.timeout(30)
def test_one_honest_donor_alone_is_taken() -> None:
    """A tiny swarm: one donor, no attacker. Its state is taken whatever its version."""
    for version in (0.0, 1.0, 1.7e9):
        assert first_root([ad(1, 1, version)], 0) == bytes([1]) * 32
    assert choose_donors([ad(1, 1, 5.0)], exclude=bytes([1]) * 20) == []
