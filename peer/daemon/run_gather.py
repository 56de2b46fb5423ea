"""Reading a run's view from a DHT node (``swarmavg peers``, the bare DHT node's
``Peers`` answer, ``swarmavg monitor``).

:mod:`swarmavg.peer.client.run_view` is pure; this module does the DHT reads (one progress key
per training method, and the trainer entries that name the training runs) and hands them,
with the node's routing table, to ``build_view``.
"""

from __future__ import annotations

import asyncio
import time
from typing import Any

from swarmavg.averaging.run_records.progress import PeerProgress, parse_records
from swarmavg.averaging.run_records.trainers import trainers_key, training_runs
from swarmavg.dht import DHTNode, ValueWithExpiration
from swarmavg.peer.client.run_view import (
    Neighbour,
    ThisPeer,
    add_training_runs,
    build_view,
    progress_keys,
)
from swarmavg.proto import control_pb2


async def read_value(node: DHTNode, key: str) -> tuple[bool, Any]:
    """``(found, value)`` of ``key``: the newest value, a dictionary value as a plain map
    subkey -> value (the expirations dropped), as ``client.dht.get`` returns it."""
    found = await node.get(key, latest=True)
    if found is None:
        return False, None
    value = found.value
    if (
        isinstance(value, dict)
        and value
        and all(isinstance(v, ValueWithExpiration) for v in value.values())
    ):
        return True, {k: v.value for k, v in value.items()}
    return True, value


def neighbours_of(node: DHTNode) -> list[Neighbour]:
    """The node's routing table, each contact with the seconds since it was last heard."""
    now = time.monotonic()
    return [
        Neighbour(c.peer_id.hex(), c.address, max(now - c.last_seen, 0.0)) for c in node.routing
    ]


async def gather_view(
    node: DHTNode, run_id: str, training_run: str, this: ThisPeer
) -> control_pb2.PeersResponse:
    """Every peer of the run and its progress, as ``node`` sees it.

    Args:
        node: a started DHT node (full or client mode).
        run_id: the node's run (named in the answer).
        training_run: the run id the trainers report under; empty: ``run_id``.
        this: the node that answers (listed first).
    """
    keys = progress_keys(training_run or run_id)
    values = await asyncio.gather(
        *(read_value(node, key) for key in (*keys.values(), trainers_key(run_id)))
    )
    found_runs, runs = values.pop()
    now = time.time()
    records: dict[str, list[PeerProgress]] = {}
    ignored = 0
    for method, (found, value) in zip(keys, values, strict=True):
        records[method], bad = parse_records(value if found else None, now)
        ignored += bad
    view = build_view(run_id, this, neighbours_of(node), records, now, ignored)
    add_training_runs(view, training_runs(runs if found_runs else None))
    return view
