"""An honest round beside stalled data-plane headers from five networks; prints ONE JSON line.

The scenario of ``tests/attacks/test_data_plane_budget.py``: 4 in-process members on real
gRPC servers and the real data plane (127.0.0.1, ``limit_local_ranges`` on), 2 MiB each in
1 MiB chunks. The control round runs alone; then 240 connections from 127.0.1.1 ... 127.0.5.1
(five /24s, 48 each) each send one 4 MiB frame header and no body to the reducer of part 0,
and the same members run ``rounds`` more rounds. It uses only APIs that exist before the
pending pool too, so the same script measures the code before the change (run it with that
checkout first on ``PYTHONPATH``) and after.

Fields: ``control_s`` and ``attack_s`` (median seconds of a round), ``control_whole`` and
``attack_whole`` (rounds that ended with every part averaged, of ``rounds``),
``attack_held_before_mib`` and ``attack_held_mib`` (the reducer's budget held once the
headers were sent, and after the attacked rounds), ``attack_refused`` (attacker connections
that the reducer refused or reset while they were being opened).

Usage: ``python -m tests.attacks.data_plane_budget_report [rounds]``.
"""

from __future__ import annotations

import asyncio
import dataclasses
import json
import statistics
import struct
import sys
import time
from typing import Any

import numpy as np

from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.framing import MAGIC
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import FAST, close_peers, make_group, run_group, start_peers
from tests.harness import GrpcServerPool

ATTACKERS = [f"127.0.{i}.1" for i in range(1, 6)]
PER_ADDRESS = 48
HONEST = 4
HELLO = struct.pack("<IB", len(MAGIC), 0) + MAGIC
STALLED_HEADER = struct.pack("<IB", 4 << 20, 1)


def _config() -> AllReduceConfig:
    names = {f.name for f in dataclasses.fields(AllReduceConfig)}
    settings = {"chunk_bytes": 1 << 20, "limit_local_ranges": True}
    return dataclasses.replace(FAST, **{k: v for k, v in settings.items() if k in names})


async def _round(peers: list[Any], channels: ChannelPool, seed: int) -> tuple[float, bool]:
    rng = np.random.default_rng(seed)
    inputs = [[rng.standard_normal(1 << 19).astype(np.float32)] for _ in peers]
    group = make_group(peers, inputs[0])
    started = time.perf_counter()
    results = await run_group(peers, group, inputs, [1.0] * len(peers), channels, timeout=30)
    seconds = time.perf_counter() - started
    whole = all(isinstance(r, AveragingResult) and not r.partial for r in results)
    return seconds, whole


async def main(rounds: int) -> None:
    servers = GrpcServerPool()
    channels = ChannelPool()
    peers = await start_peers(servers, HONEST, _config(), data_plane=True)
    writers: list[asyncio.StreamWriter] = []
    out: dict[str, Any] = {"bench": "data_plane_budget_attack", "rounds": rounds}
    try:
        control = [await _round(peers, channels, seed) for seed in range(rounds)]
        for source in ATTACKERS:
            for _ in range(PER_ADDRESS):
                try:
                    reader, writer = await asyncio.open_connection(
                        "127.0.0.1", peers[0].data_port, local_addr=(source, 0)
                    )
                    writers.append(writer)
                    writer.write(HELLO)
                    await asyncio.wait_for(reader.readexactly(len(HELLO)), 10.0)
                    writer.write(STALLED_HEADER)
                except (asyncio.IncompleteReadError, OSError, TimeoutError):
                    out["attack_refused"] = out.get("attack_refused", 0) + 1
        budget = peers[0].service.data_plane_budget
        if budget is not None:  # the headers read: the attack stands
            await asyncio.sleep(1.0)
            out["attack_held_before_mib"] = round(budget.held / (1 << 20), 1)
        attack = [await _round(peers, channels, 100 + seed) for seed in range(rounds)]
        out.update(
            control_s=round(statistics.median(s for s, _ in control), 3),
            control_whole=sum(w for _, w in control),
            attack_s=round(statistics.median(s for s, _ in attack), 3),
            attack_whole=sum(w for _, w in attack),
            attack_held_mib=round(budget.held / (1 << 20), 1) if budget is not None else None,
        )
    finally:
        for writer in writers:
            writer.close()
        await close_peers(peers)
        await channels.close()
        await servers.close()
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(int(sys.argv[1]) if len(sys.argv) > 1 else 3))
