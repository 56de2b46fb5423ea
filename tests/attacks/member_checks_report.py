"""What the member-side part check and the slow-sender bound cost and catch. Prints ONE JSON line.

    python -m tests.attacks.member_checks_report --mb 16 --pairs 5

- ``honest``: the part check's rule on simulated honest rounds (2-8 members; layers whose
  scales differ by e^4 either way; shapes as in tests/averaging/allreduce/test_part_check.py): per
  shape the largest ratio of an honest part to the median of the others (what
  ``part_deviation_factor`` must stay above), and the share of member-rounds refused.
- ``detection``: the share of members that refuse a part forged as ``-c`` times the honest
  average (shared-signal gradients), per ``c``, at the default factor.
- ``tally_ns_per_element``: the check's pass over one decoded chunk (1 MiB of float32).
- ``rounds``: in-process 4-member rounds of ``--mb`` MB each (one event loop: the members'
  costs add up), the check on and off in interleaved pairs, out of place and in place (the
  daemon's shared memory, where the averages are held until checked): medians and ratio.
- ``slow_sender``: the attack of tests/attacks/test_slow_sender.py (one member of four
  paces its chunks just inside the stall detector's patience): the honest members' round
  time and outcome beside a control round.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import statistics
import time
from typing import Any

import numpy as np

from swarmavg.averaging.aggregation import canonical_aggregation
from swarmavg.averaging.allreduce import streams
from swarmavg.averaging.allreduce.part_check import (
    DEFAULT_FACTOR,
    DeviationTally,
)
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.attacks.test_slow_sender import (
    ATTACKER,
    CHUNKS_PER_PART,
    MEMBERS,
    TRICKLE,
    PacedCall,
    _round,
)
from tests.averaging.allreduce.test_part_check import SHAPES, _deviations, _honest_round, _refused
from tests.averaging.allreduce_peers import (
    FAST,
    close_peers,
    make_group,
    run_group,
    start_peers,
)
from tests.harness import GrpcServerPool


def honest_ratios(trials: int) -> dict[str, Any]:
    rng = np.random.default_rng(0)
    worst: dict[str, float] = {}
    refused = 0
    checked = 0
    for shape in SHAPES:
        for t in range(trials):
            members = 2 + t % 7
            size = int(rng.integers(6000 * members, 200_000))
            values = _honest_round(rng, shape, members, size)
            average = np.mean(values, axis=0).astype(np.float32)
            for i, own in enumerate(values):
                deviations = _deviations(average, own, members, chunk=50_000)
                checked += 1
                refused += bool(_refused(average, own, members, i, chunk=50_000))
                for q, mine in deviations.items():
                    others = [d.relative for p, d in deviations.items() if p != q]
                    if others:
                        ratio = mine.relative / max(float(np.median(others)), 0.25 / 8)
                        worst[shape] = max(worst.get(shape, 0.0), ratio)
    return {
        "worst_ratio": {k: round(v, 2) for k, v in worst.items()},
        "refused": refused,
        "member_rounds": checked,
    }


def detection(trials: int) -> dict[str, float]:
    rng = np.random.default_rng(1)
    out = {}
    for c in (2.0, 4.0, 10.0, 1e6):
        caught = total = 0
        for t in range(trials):
            members = 2 + t % 7
            values = _honest_round(rng, "shared-signal", members, 8000 * members)
            average = np.mean(values, axis=0).astype(np.float32)
            last = np.array_split(np.arange(average.size), members)[-1]
            forged = average.copy()
            forged[last] = -c * average[last]
            for i in range(members - 1):
                total += 1
                caught += (members - 1) in _refused(forged, values[i], members, i, chunk=50_000)
        out[f"{c:g}"] = round(caught / total, 3)
    return out


def tally_cost() -> float:
    rng = np.random.default_rng(2)
    result = rng.standard_normal(1 << 18).astype(np.float32)
    own = rng.standard_normal(1 << 18).astype(np.float32)
    times = []
    for _ in range(50):
        tally = DeviationTally()
        start = time.perf_counter()
        tally.add(result, own)
        times.append(time.perf_counter() - start)
    return statistics.median(times) / own.size * 1e9


async def rounds(mb: float, pairs: int) -> dict[str, Any]:
    size = int(mb * (1 << 20) / 4)
    servers = GrpcServerPool()
    channels = ChannelPool()
    configs = {
        "on": dataclasses.replace(FAST, chunk_bytes=1 << 20, min_stall=5.0),
        "off": dataclasses.replace(
            FAST, chunk_bytes=1 << 20, min_stall=5.0, part_deviation_factor=None
        ),
    }
    peers = {k: await start_peers(servers, 4, c, data_plane=True) for k, c in configs.items()}
    rng = np.random.default_rng(3)
    times: dict[str, list[float]] = {f"{k}-{m}": [] for k in configs for m in ("out", "in")}
    try:
        for p in range(pairs):
            for place in ("out", "in"):
                order = ["on", "off"] if p % 2 == 0 else ["off", "on"]
                for key in order:
                    inputs = [[rng.standard_normal(size).astype(np.float32)] for _ in range(4)]
                    outs = list(inputs) if place == "in" else None
                    # the check runs in rounds of a robust rule: its cost is measured there
                    group = dataclasses.replace(
                        make_group(peers[key], inputs[0]),
                        aggregation=canonical_aggregation("centered-clip"),
                    )
                    start = time.perf_counter()
                    results = await run_group(
                        peers[key], group, inputs, [1.0] * 4, channels, timeout=120, outs=outs
                    )
                    times[f"{key}-{place}"].append(time.perf_counter() - start)
                    for r in results:
                        if not isinstance(r, AveragingResult) or r.partial:
                            raise RuntimeError(f"round failed: {r!r}")
    finally:
        for group_peers in peers.values():
            await close_peers(group_peers)
        await channels.close()
        await servers.close()
    medians = {k: round(statistics.median(v), 4) for k, v in times.items()}
    return {
        "mb": mb,
        "pairs": pairs,
        "median_s": medians,
        "ratio_on_off": {
            m: round(medians[f"on-{m}"] / medians[f"off-{m}"], 3) for m in ("out", "in")
        },
        # each pair's two rounds ran back to back: their ratio cancels the load that
        # drifts over the run, which moves the medians of either column by more
        "pair_ratio_median": {
            m: round(
                statistics.median(
                    a / b for a, b in zip(times[f"on-{m}"], times[f"off-{m}"], strict=True)
                ),
                3,
            )
            for m in ("out", "in")
        },
    }


async def _timed_round(peers: Any, channels: ChannelPool, written: list[int]) -> dict[str, Any]:
    """The honest members' time and outcome in one round, and how many chunks the attacker
    had written when the last of them had its result."""
    honest, seen, ended = await _round(peers, channels, seed=4, written=written)
    return {
        "honest_s": round(ended, 3),
        "partial": [r.partial for r in honest],
        "attacker_chunks_sent_when_honest_done": seen,
        "dropped": sorted({reason for r in honest for reason in r.dropped.values()}),
    }


async def slow_sender() -> dict[str, Any]:
    servers = GrpcServerPool()
    channels = ChannelPool()
    peers = await start_peers(servers, MEMBERS, FAST, data_plane=False)
    written = [0]
    open_call = streams.PartStreams._open_call
    pacing: dict[int, float] = {}

    async def paced_open_call(self: Any, part: int, address: str) -> Any:
        call = await open_call(self, part, address)
        if self.my_index not in pacing:
            return call
        return PacedCall(call, pacing[self.my_index], written)

    streams.PartStreams._open_call = paced_open_call  # type: ignore[method-assign]
    out: dict[str, Any] = {"chunks_of_attacker": (MEMBERS - 1) * CHUNKS_PER_PART}
    try:
        out["control"] = await _timed_round(peers, channels, written)
        pacing[ATTACKER] = TRICKLE
        out["attack"] = await _timed_round(peers, channels, written)
    finally:
        streams.PartStreams._open_call = open_call  # type: ignore[method-assign]
        await close_peers(peers)
        await channels.close()
        await servers.close()
    return out


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--mb", type=float, default=16.0)
    parser.add_argument("--pairs", type=int, default=5)
    parser.add_argument("--trials", type=int, default=40)
    args = parser.parse_args()
    figures: dict[str, Any] = {
        "factor": DEFAULT_FACTOR,
        "honest": honest_ratios(args.trials),
        "detection": detection(args.trials),
        "tally_ns_per_element": round(tally_cost(), 3),
        "rounds": asyncio.run(rounds(args.mb, args.pairs)),
        "slow_sender": asyncio.run(slow_sender()),
    }
    print(json.dumps(figures))


if __name__ == "__main__":
    main()
