"""Moshpit group bits: the grid walk gives every peer the exact global mean after d rounds."""

from __future__ import annotations

import itertools
import os
from fractions import Fraction

import pytest

from swarmavg.averaging.matchmaking.keys import (
    GroupKeyManager,
    bits_for_group_size,
    bucket_for_member,
    companions,
    matchmaking_key,
    next_group_bits,
    validate_bits,
)


def simulate(
    num_peers: int, group_size: int, rounds: int, initial_bits: list[str]
) -> list[Fraction]:
    """Group peers by their bits each round (sorted order in a group), average exactly."""
    values = [Fraction(i * i + 3 * i) for i in range(num_peers)]
    bits = list(initial_bits)
    for r in range(rounds):
        groups: dict[str, list[int]] = {}
        for peer, b in enumerate(bits):
            groups.setdefault(b, []).append(peer)
        for members in groups.values():
            assert len(members) == group_size, (r, groups)
            mean = sum(values[p] for p in members) / len(members)
            group_id = os.urandom(16)
            for index, peer in enumerate(members):
                values[peer] = mean
                bits[peer] = next_group_bits(bits[peer], group_id, index, len(members))
    return values


@pytest.mark.parametrize(("group_size", "dims"), [(4, 2), (2, 4), (4, 3), (8, 2), (2, 1)])
def test_grid_rounds_give_exact_global_mean(group_size: int, dims: int) -> None:
    num_peers = group_size**dims
    per_round = bits_for_group_size(group_size)
    nbits = (dims - 1) * per_round
    # Initial coordinates: peer p sits at grid cell p // group_size (all but the first axis).
    initial = [format(p // group_size, f"0{nbits}b") if nbits else "" for p in range(num_peers)]
    values = simulate(num_peers, group_size, dims, initial)
    exact = Fraction(sum(i * i + 3 * i for i in range(num_peers)), num_peers)
    assert all(v == exact for v in values)


def test_one_round_too_few_does_not_mix_everyone() -> None:
    # Control for the oracle above: with d - 1 rounds the mean is not global yet.
    initial = [format(p // 4, "02b") for p in range(16)]
    values = simulate(16, 4, 1, initial)
    exact = Fraction(sum(i * i + 3 * i for i in range(16)), 16)
    assert any(v != exact for v in values)


def test_buckets_distinct_within_a_group() -> None:
    for group_size, nbits in [(4, 2), (3, 2), (8, 3), (5, 3)]:
        gid = os.urandom(8)
        buckets = [bucket_for_member(gid, i, group_size, nbits) for i in range(group_size)]
        assert len(set(buckets)) == group_size
        assert all(0 <= b < 2**nbits for b in buckets)


def test_buckets_depend_on_group_id() -> None:
    seen = {tuple(bucket_for_member(bytes([g]), i, 4, 2) for i in range(4)) for g in range(40)}
    assert len(seen) > 1
    assert all(sorted(s) == [0, 1, 2, 3] for s in seen)


def test_bits_keep_length_and_shift() -> None:
    assert next_group_bits("", b"g", 0, 4) == ""
    out = next_group_bits("1011", b"g", 2, 4)
    assert len(out) == 4
    assert out[:2] == "11"
    # Groups of one carry no information: bits unchanged.
    assert next_group_bits("10", b"g", 0, 1) == "10"


def test_key_format_and_validation() -> None:
    assert matchmaking_key("run", "step-1", "01") == "run.step-1.0b01"
    assert matchmaking_key("run", "k", "") == "run.k.0b"
    with pytest.raises(ValueError, match="0/1"):
        validate_bits("012")
    with pytest.raises(ValueError, match="non-empty"):
        matchmaking_key("run", "", "")
    manager = GroupKeyManager("run", "10")
    assert manager.key_for("k") == "run.k.0b10"
    manager.on_group_formed(b"gid", 1, 4)
    assert len(manager.group_bits) == 2
    assert set(itertools.chain(manager.group_bits)) <= {"0", "1"}


@pytest.mark.parametrize(("group_size", "num_peers"), [(16, 64), (16, 128), (16, 256), (8, 32)])
def test_folded_grid_two_rounds_give_exact_global_mean(group_size: int, num_peers: int) -> None:
    """N = g * 2**b peers with b < log2(g) initial bits (benchmarks/scale.py):
    round 1 folds the g members of a round-0 group onto 2**b buckets, g / 2**b in each, so
    every round-1 group takes as many peers from every round-0 group: exact after 2 rounds."""
    nbits = (num_peers // group_size).bit_length() - 1
    initial = [format(p // group_size, f"0{nbits}b") for p in range(num_peers)]
    values = simulate(num_peers, group_size, 2, initial)
    exact = Fraction(sum(i * i + 3 * i for i in range(num_peers)), num_peers)
    assert all(v == exact for v in values)


@pytest.mark.parametrize("bits", ["", "0", "01", "0110"])
@pytest.mark.parametrize("size", [1, 2, 3, 4, 8, 16])
def test_companions_are_exactly_the_members_with_the_same_next_bits(bits: str, size: int) -> None:
    group_id = bytes(range(20))
    nexts = [next_group_bits(bits, group_id, j, size) for j in range(size)]
    for index in range(size):
        together = companions(bits, group_id, index, size)
        assert index in together
        assert together == {j for j in range(size) if nexts[j] == nexts[index]}
    if not bits:
        assert companions(bits, group_id, 0, size) == set(range(size))


def test_the_key_manager_says_who_moves_along_with_it() -> None:
    manager = GroupKeyManager("run", "01")
    together = manager.on_group_formed(b"g" * 20, 1, 4)
    assert together == companions("01", b"g" * 20, 1, 4)
    assert manager.group_bits == next_group_bits("01", b"g" * 20, 1, 4)
