"""A seeded timing harness: in-process peers that call at their own pace.

Real training processes start seconds apart and compute for their own time between
calls; a test that starts every call at one instant proves the lab case only. Here every
peer runs its own loop (a random start offset, a random compute time before each call)
and sees its own DHT latency (a random delay on every store and read of the matchmaker's),
all drawn from one seed, so a failing schedule can be replayed.
"""

from __future__ import annotations

import asyncio
import random
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from swarmavg.averaging.result import AveragingResult
from tests.averaging.averager_swarm import AveragerSwarm, Peer


class DelayedDHT:
    """The matchmaker's view of a DHT node, with a random delay before every store and
    read (this peer's latency to the DHT): the seam through which the harness slows a
    peer's declarations and reads without touching the protocol."""

    def __init__(self, node: Any, rng: random.Random, max_delay: float) -> None:
        self._node = node
        self._rng = rng
        self._max_delay = max_delay

    def __getattr__(self, name: str) -> Any:
        return getattr(self._node, name)

    async def _delay(self) -> None:
        await asyncio.sleep(self._rng.uniform(0.0, self._max_delay))

    async def store(self, *args: Any, **kwargs: Any) -> Any:
        await self._delay()
        return await self._node.store(*args, **kwargs)

    async def get(self, *args: Any, **kwargs: Any) -> Any:
        await self._delay()
        return await self._node.get(*args, **kwargs)

    async def store_and_get(self, *args: Any, **kwargs: Any) -> Any:
        await self._delay()
        return await self._node.store_and_get(*args, **kwargs)


@dataclass(frozen=True)
class Timing:
    """How the peers' calls are spread.

    Attributes:
        seed: draws every offset, compute time and delay below.
        start_spread: each peer's first call comes up to this many seconds after the test
            starts (processes that start apart).
        compute: before each call a peer computes up to this many seconds.
        dht_delay: each of a peer's DHT stores and reads waits up to this many seconds.
    """

    seed: int
    start_spread: float = 1.0
    compute: float = 0.5
    dht_delay: float = 0.05


@dataclass
class Outcome:
    """What every peer got in every round: a result, or the exception it raised."""

    rounds: list[list[AveragingResult | BaseException]] = field(default_factory=list)

    def problems(self, n: int) -> list[str]:
        """Rounds that were not one group of ``n`` with every peer in it."""
        found = []
        for r, outcomes in enumerate(self.rounds):
            errors = [repr(o) for o in outcomes if isinstance(o, BaseException)]
            ok = [o for o in outcomes if isinstance(o, AveragingResult)]
            groups = {o.group_id for o in ok}
            sizes = sorted(o.group_size for o in ok)
            if errors or len(groups) != 1 or sizes != [n] * n:
                found.append(f"round {r}: group sizes {sizes}, errors {errors}")
        return found


async def run_unsynchronised(
    swarm: AveragerSwarm,
    timing: Timing,
    rounds: int,
    *,
    key: str = "step",
    timeout: float = 30.0,
) -> Outcome:
    """Every peer of ``swarm`` runs ``rounds`` calls of ``average`` under ``{key}-{r}`` at
    its own pace (see :class:`Timing`); returns what each got, round by round."""
    rng = random.Random(timing.seed)
    peers: Sequence[Peer] = swarm.peers
    for peer in peers:
        matchmaker = peer.averager.matchmaker
        matchmaker.dht = DelayedDHT(matchmaker.dht, random.Random(rng.random()), timing.dht_delay)
    offsets = [rng.uniform(0.0, timing.start_spread) for _ in peers]
    computes = [[rng.uniform(0.0, timing.compute) for _ in range(rounds)] for _ in peers]
    outcome = Outcome([[] for _ in range(rounds)])

    async def loop(i: int, peer: Peer) -> None:
        await asyncio.sleep(offsets[i])
        tensors = [np.full(64, float(i), dtype=np.float32)]
        for r in range(rounds):
            await asyncio.sleep(computes[i][r])
            try:
                result: AveragingResult | BaseException = await peer.averager.average(
                    tensors, f"{key}-{r}", timeout=timeout
                )
            except Exception as error:  # recorded: the test reports every failed round
                result = error
            outcome.rounds[r].append(result)

    async with asyncio.TaskGroup() as tasks:
        for i, peer in enumerate(peers):
            tasks.create_task(loop(i, peer))
    return outcome
