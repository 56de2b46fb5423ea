"""What ``client.publish_state`` costs: a training wrapper publishes its state after every step.

One real ``swarmavg peer`` daemon on loopback and two clients of it through the public API:
one that hands states over through shared memory (``connect()``, the default) and one
through the control socket (``connect(use_shm=False)``, the path every publish took
before). Each publish changes one tensor of the state, as a training step changes it. The
two paths take turns, publish by publish, so both meet the same load. Figures per path: the
client's CPU and the daemon's CPU per publish (each a total over ``--publishes`` divided by
their count, since /proc counts whole clock ticks; the daemon's includes the advertisement
each publish sends in the background) and the median wall time of one publish. Prints ONE
JSON line.

    python -m benchmarks.publish_state --mb 8.5 --publishes 40
"""

from __future__ import annotations

import argparse
import sys
import tempfile
from pathlib import Path
from typing import Any

import numpy as np

from .common import PathCosts, emit, random_state, start_daemons

PATHS = ("shm", "socket")
SETTLE = 0.05
"""Seconds after each publish before the next, so its background advertisement is counted
with it."""


def run(args: argparse.Namespace) -> dict[str, Any]:
    from swarmavg.peer import connect

    state = random_state(args.mb, args.tensors)
    with (
        tempfile.TemporaryDirectory(prefix="sa-publish-") as work,
        open(Path(work) / "daemon.log", "w") as log_file,
    ):
        ((daemon, control),) = start_daemons(Path(work), 1, log_file, "publish-bench")
        try:
            clients = {"shm": connect(control), "socket": connect(control, use_shm=False)}
            costs = PathCosts(PATHS, [daemon.pid])
            measure(clients, costs, state, args.publishes)
            for client in clients.values():
                client.close()
        finally:
            daemon.close()
    return {
        "benchmark": "publish_state",
        "mb": args.mb,
        "tensors": args.tensors,
        "publishes": args.publishes,
        **costs.figures(),
    }


def measure(
    clients: dict[str, Any], costs: PathCosts, state: list[np.ndarray], publishes: int
) -> None:
    """``publishes`` publishes along each path, taking turns."""
    for client in clients.values():  # the first publish makes the segment and advertises
        client.publish_state(state, {"epoch": -1})
    for index in range(publishes):
        state[index % len(state)] += 1.0  # a training step changes the state
        for path in PATHS if index % 2 == 0 else PATHS[::-1]:
            with costs.call(path, settle=SETTLE):
                clients[path].publish_state(state, {"epoch": index})


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=8.5, help="state size, MB (1e6 bytes)")
    parser.add_argument("--tensors", type=int, default=20)
    parser.add_argument("--publishes", type=int, default=40, help="publishes per path")
    emit(run(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
