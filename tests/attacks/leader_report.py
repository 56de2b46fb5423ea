"""The honest peers' rounds under a hostile leader, beside the control; prints ONE JSON line.

Real averagers in one process (real DHT nodes, real gRPC, 127.0.0.1), as in
``tests/attacks/test_leader_rank.py``, ``test_leader_stall.py`` and
``test_leader_sybil_fill.py``. It uses only APIs that exist before leader order went by
rank, so the same script measures the older code too (run it with that checkout first on
``PYTHONPATH``): where ``leader_order`` is missing, a plain round name is used, and the
attacker leads by its early declared start there.

- ``early_claim``: 5 peers, one of which signs ``start = now - 590``, run ``rounds``
  rounds (calls at seeded offsets up to 0.5 s): rounds the attacker led, rounds that
  formed one group of 5, median round seconds.
- ``silent_leader``: 3 honest peers (after one round of the family among themselves) and
  an attacker that ranks first, accepts every follower and never closes: how many honest
  calls returned a result, in how many groups, and the call's seconds; ``control``: the
  same without the attacker.
- ``sybil_fill``: 3 honest peers and an attacker that forms each follower's group with 3
  identities signing addresses in one /24: honest results, whether any was partial, and
  the call's seconds; ``control``: the same without the attacker.

Usage: ``python -m tests.attacks.leader_report [--rounds 8]`` from the repository root.
It lives beside the attack tests because it re-runs their scenarios (their attacker
builders are test code, which benchmarks/ does not import).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import time
from typing import Any

import numpy as np

from swarmavg.averaging.matchmaking.keys import matchmaking_key
from swarmavg.averaging.result import AveragingResult
from tests.attacks.leader_scenarios import (
    claim_early_starts,
    sign_sybils,
    silent_join,
    stage,
    sybil_join,
)
from tests.averaging.averager_swarm import RUN_ID, Peer, averager_swarm
from tests.averaging.matchmaking.test_bounded_leaders import hostile_server, inputs

try:
    from swarmavg.averaging.matchmaking.declarations import leader_order
except ImportError:  # the older code: the earliest declared start leads
    leader_order = None  # type: ignore[assignment]


def first_name(first: Peer, others: list[Peer], prefix: str) -> str:
    """A round name under which ``first`` ranks before ``others`` (any name before)."""
    if leader_order is None:
        return f"{prefix}1"
    bits = first.averager.group_bits
    for i in range(100_000):
        key = matchmaking_key(RUN_ID, f"{prefix}{i}", bits)
        mine = leader_order(key, first.peer_id)
        if all(mine < leader_order(key, p.peer_id) for p in others):
            return f"{prefix}{i}"
    raise RuntimeError("no such name")


def outcome(results: list[Any], seconds: float) -> dict[str, Any]:
    ok = [r for r in results if isinstance(r, AveragingResult)]
    return {
        "results": len(ok),
        "calls": len(results),
        "groups": len({r.group_id for r in ok}),
        "partial": any(r.partial for r in ok),
        "errors": sorted({type(r).__name__ for r in results if isinstance(r, BaseException)}),
        "seconds": round(seconds, 2),
    }


async def early_claim(rounds: int) -> dict[str, Any]:
    async with averager_swarm(5) as swarm:
        attacker = swarm.peers[0]
        claim_early_starts(attacker)
        matchmaker = attacker.averager.matchmaker
        rng = random.Random(7)
        led = one_group = 0
        seconds = []
        for r in range(rounds):
            before = sum(matchmaker.closes.values())

            async def call(i: int, peer: Peer, offset: float, name: str = f"r{r}") -> Any:
                await asyncio.sleep(offset)
                return await peer.averager.average(
                    [np.full(8, i, np.float32)], name, group_size=5, timeout=30
                )

            started = time.monotonic()
            results = await asyncio.gather(
                *(call(i, p, rng.uniform(0.0, 0.5)) for i, p in enumerate(swarm.peers)),
                return_exceptions=True,
            )
            seconds.append(time.monotonic() - started)
            ok = [x for x in results if isinstance(x, AveragingResult)]
            one_group += len(ok) == 5 and len({x.group_id for x in ok}) == 1
            led += sum(matchmaker.closes.values()) > before
        return {
            "rounds": rounds,
            "attacker_led": led,
            "one_group_rounds": one_group,
            "median_round_s": round(statistics.median(seconds), 2),
        }


async def silent_leader(attack: bool) -> dict[str, Any]:
    async with averager_swarm(4) as swarm:
        attacker, *honest = swarm.peers
        name = first_name(attacker, honest, "s")
        await asyncio.gather(
            *(p.averager.average(inputs(), "s", group_size=3, timeout=24) for p in honest)
        )
        key = matchmaking_key(RUN_ID, name, honest[0].averager.group_bits)

        async with hostile_server(silent_join(attacker, [])) as address:
            await stage(attack, attacker, address, key)
            started = time.monotonic()
            results = await asyncio.gather(
                *(p.averager.average(inputs(), name, timeout=24) for p in honest),
                return_exceptions=True,
            )
            return outcome(list(results), time.monotonic() - started)


async def sybil_fill(attack: bool) -> dict[str, Any]:
    async with averager_swarm(7) as swarm:
        attacker, *rest = swarm.peers
        honest, sybils = rest[:3], rest[3:]
        name = first_name(attacker, honest, "f")
        key = matchmaking_key(RUN_ID, name, honest[0].averager.group_bits)
        box: list[str] = []
        async with hostile_server(sybil_join(attacker, box, sybils, [])) as address:
            box.append(address)
            await stage(attack, attacker, address, key)
            if attack:
                await sign_sybils(sybils, key)
            started = time.monotonic()
            results = await asyncio.gather(
                *(
                    p.averager.average(inputs(), name, group_size=8, min_group_size=2, timeout=20)
                    for p in honest
                ),
                return_exceptions=True,
            )
            return outcome(list(results), time.monotonic() - started)


async def main(rounds: int) -> dict[str, Any]:
    return {
        "benchmark": "leader_attacks",
        "leader_order": "rank" if leader_order is not None else "earliest-start",
        "early_claim": await early_claim(rounds),
        "silent_leader": {
            "attack": await silent_leader(True),
            "control": await silent_leader(False),
        },
        "sybil_fill": {"attack": await sybil_fill(True), "control": await sybil_fill(False)},
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=int, default=8)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main(args.rounds))), flush=True)
