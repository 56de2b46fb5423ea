"""RPCs one DHT maintenance round costs each node of a stable swarm; prints ONE JSON line.

    python -m benchmarks.dht_maintenance [--nodes 128] [--rounds 2] [--one-initial-peer]

Grows ``--nodes`` nodes in one process (background maintenance disabled, so only the rounds
run here count), then calls ``maintain_once`` on every node ``--rounds`` times and reports
the RPCs sent per node in each round, and the requests the first node served in each round.
Each node joins through a random earlier node, or with ``--one-initial-peer`` through the
first node, as the volunteers of a public run all join through its published address: the
first node's count is then that address's maintenance load. To compare two checkouts, run
this script with each one's interpreter (the ``code`` field says which
``swarmavg.dht.node`` ran).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random

from swarmavg.dht import ChannelPool, DHTConfig, DHTNode
from swarmavg.dht import node as node_module


async def main_async(
    nodes_wanted: int, rounds: int, seed: int, one_initial_peer: bool
) -> dict[str, object]:
    rng = random.Random(seed)
    channels = ChannelPool()
    nodes: list[DHTNode] = []
    config = DHTConfig(run_id="bench", request_timeout=5.0, maintenance_interval=3600.0)
    try:
        while len(nodes) < nodes_wanted:
            first = nodes[:1] if one_initial_peer else nodes
            initial = [rng.choice(first).address or ""] if nodes else []
            cfg = DHTConfig(**{**config.__dict__, "initial_peers": initial})
            nodes.append(await DHTNode.create(cfg, channels=channels))
        per_round, first_served = [], []
        for _ in range(rounds):
            before = sum(n.protocol.rpcs_sent for n in nodes)
            served_before = nodes[0].protocol.rpcs_received
            for node in nodes:
                await node.maintain_once()
            sent = sum(n.protocol.rpcs_sent for n in nodes) - before
            per_round.append(round(sent / len(nodes), 2))
            first_served.append(nodes[0].protocol.rpcs_received - served_before)
    finally:
        for node in nodes:
            await node.shutdown()
        await channels.close()
    return {
        "benchmark": "dht_maintenance",
        "code": node_module.__file__,
        "nodes": nodes_wanted,
        "one_initial_peer": one_initial_peer,
        "rpcs_per_node_per_round": per_round,
        "first_node_served_per_round": first_served,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--nodes", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--one-initial-peer", action="store_true", help="every node joins through the first"
    )
    args = parser.parse_args()
    os.environ.setdefault("GRPC_VERBOSITY", "ERROR")
    print(
        json.dumps(
            asyncio.run(main_async(args.nodes, args.rounds, args.seed, args.one_initial_peer))
        )
    )


if __name__ == "__main__":
    main()
