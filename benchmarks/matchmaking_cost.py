"""What forming one group costs: DHT RPCs and CPU per round of N peers; ONE JSON line.

    python -m benchmarks.matchmaking_cost [--peers 8] [--rounds 8]

N real peers (DHT node, gRPC server, averager) in one process on loopback average a tiny
tensor under a new key each round, in the default configuration (no ``group_size``), as
a training loop does. After two warm-up rounds it reports, per round (median): the DHT
RPCs all peers sent, the CPU seconds the process used, and the matchmaking phase (median
over the members). RPCs and CPU are what a loaded machine changes least; the wall-clock
phase is only meaningful on a quiet one. To compare two checkouts, run the script with
each one's interpreter (``code`` says which package ran).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import time

import grpc
import numpy as np

from swarmavg.averaging import averager as averager_module
from swarmavg.averaging.averager import Averager, AveragerConfig
from swarmavg.dht import ChannelPool, DHTConfig, DHTNode

RUN_ID = "bench"


async def start_peer(
    initial: list[str], config: AveragerConfig
) -> tuple[DHTNode, Averager, grpc.aio.Server, ChannelPool]:
    channels = ChannelPool()
    node = DHTNode(DHTConfig(run_id=RUN_ID, initial_peers=initial), channels=channels)
    server = grpc.aio.server()
    node.add_to_server(server)
    averager = Averager(node, config, channels)
    averager.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    await server.start()
    await node.start(f"127.0.0.1:{port}")
    await averager.start()
    return node, averager, server, channels


async def main_async(peers: int, rounds: int, warmup: int) -> dict[str, object]:
    config = AveragerConfig(matchmaking_time=5.0)
    started: list[tuple[DHTNode, Averager, grpc.aio.Server, ChannelPool]] = []
    try:
        for _ in range(peers):
            initial = [started[0][0].address or ""] if started else []
            started.append(await start_peer(initial, config))
        rpcs, cpu, matchmaking, smallest = [], [], [], []
        for step in range(warmup + rounds):
            sent_before = sum(node.protocol.rpcs_sent for node, *_ in started)
            cpu_before = time.process_time()
            results = await asyncio.gather(
                *(
                    averager.average([np.full(1024, float(i), np.float32)], f"step-{step}")
                    for i, (_, averager, *_) in enumerate(started)
                )
            )
            if step >= warmup:
                rpcs.append(sum(node.protocol.rpcs_sent for node, *_ in started) - sent_before)
                cpu.append(time.process_time() - cpu_before)
                matchmaking.append(statistics.median(r.timings["matchmaking"] for r in results))
                smallest.append(min(len(r.peers) for r in results))
    finally:
        for node, averager, server, channels in started:
            await server.stop(None)
            await averager.shutdown(grace=0.0)
            await node.shutdown()
            await channels.close()
    return {
        "benchmark": "matchmaking_cost",
        "code": os.path.dirname(os.path.dirname(averager_module.__file__)),
        "peers": peers,
        "rounds": rounds,
        "dht_rpcs_per_round": statistics.median(rpcs),
        "cpu_s_per_round": round(statistics.median(cpu), 4),
        "matchmaking_s": round(statistics.median(matchmaking), 4),
        "smallest_group": min(smallest),
        "load_average": round(os.getloadavg()[0], 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", type=int, default=8)
    parser.add_argument("--rounds", type=int, default=8)
    parser.add_argument("--warmup", type=int, default=2)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(main_async(args.peers, args.rounds, args.warmup))))


if __name__ == "__main__":
    main()
