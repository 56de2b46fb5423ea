"""What ``client.load_state`` costs a joiner on the daemon's machine: the state's hop from
the daemon to the training process.

Two real ``swarmavg peer`` daemons on loopback: a client of the first publishes one state
of ``--mb``; two clients of the second load it through the public API, one through shared
memory (``connect()``, the default: the daemon writes the tensors into a segment the client
offered) and one through the control socket (``connect(use_shm=False)``, the path every load
took before). The two take turns, load by load, so both meet the same load of the machine
and the same daemon state. A timed load ends once the client has copied the tensors into
arrays of its own, as a training wrapper copies them into its parameters (a mapped segment's
pages are touched there, heap bytes from the socket were touched on arrival). Figures per
path: the client's CPU and the joining daemon's CPU per load (totals over ``--loads``
divided by their count, since /proc counts whole clock ticks) and the median wall time of
one load. Prints ONE JSON line.

    python -m benchmarks.load_state --mb 100 --loads 10
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


def run(args: argparse.Namespace) -> dict[str, Any]:
    from swarmavg.peer import connect

    state = random_state(args.mb, args.tensors)
    with (
        tempfile.TemporaryDirectory(prefix="sa-load-") as work,
        open(Path(work) / "daemons.log", "w") as log_file,
    ):
        (donor, donor_control), (joiner, control) = start_daemons(
            Path(work), 2, log_file, "load-bench"
        )
        try:
            with connect(donor_control) as publisher:
                publisher.publish_state(state, {"epoch": 1})
            clients = {"shm": connect(control), "socket": connect(control, use_shm=False)}
            costs = PathCosts(PATHS, [joiner.pid])
            measure(clients, costs, state, args.loads)
            for client in clients.values():
                client.close()
        finally:
            joiner.close()
            donor.close()
    return {
        "benchmark": "load_state",
        "mb": args.mb,
        "tensors": args.tensors,
        "loads": args.loads,
        **costs.figures(),
    }


def measure(clients: dict[str, Any], costs: PathCosts, state: list[np.ndarray], loads: int) -> None:
    """``loads`` loads along each path, taking turns; each checked against the published
    state after its timed part."""
    for client in clients.values():  # the first load finds the advert and the donor
        client.load_state(timeout=120)
    parameters = [np.empty_like(a) for a in state]
    for index in range(loads):
        for path in PATHS if index % 2 == 0 else PATHS[::-1]:
            with costs.call(path):
                _, tensors = clients[path].load_state(timeout=120)
                for parameter, tensor in zip(parameters, tensors, strict=True):
                    np.copyto(parameter, tensor)
            if not all(np.array_equal(a, b) for a, b in zip(tensors, state, strict=True)):
                raise RuntimeError(f"the {path} load differs from the published state")
            del tensors


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=float, default=100.0, help="state size, MB (1e6 bytes)")
    parser.add_argument("--tensors", type=int, default=20)
    parser.add_argument("--loads", type=int, default=10, help="loads per path")
    emit(run(parser.parse_args()))
    return 0


if __name__ == "__main__":
    sys.exit(main())
