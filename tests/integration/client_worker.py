"""A training process stand-in for the integration tests: one ``client.average`` call.

Run as ``python client_worker.py '<json spec>'``. It averages seeded random tensors through
the daemon at ``spec["control"]`` and writes ``spec["out"]``: an ``.npz`` with the result
and a ``.json`` with the outcome (or the exception's class and message).
"""

from __future__ import annotations

import faulthandler
import json
import signal
import sys
import time
from pathlib import Path
from typing import Any

import numpy as np


def make_tensors(seed: int, shapes: list[list[int]], dtype: str) -> list[np.ndarray]:
    rng = np.random.default_rng(seed)
    return [rng.standard_normal(shape).astype(dtype) for shape in shapes]


def main(spec: dict[str, Any]) -> int:
    # A test that finds this process hung sends SIGUSR1 for its threads' stacks.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    from swarmavg.peer import SwarmError, connect

    out = Path(spec["out"])
    tensors = make_tensors(spec["seed"], spec["shapes"], spec.get("dtype", "float32"))
    if spec.get("inject_nan"):
        tensors[0].flat[0] = np.nan
    record: dict[str, Any] = {}
    started = time.monotonic()
    try:
        with connect(spec["control"], use_shm=spec.get("use_shm", True)) as client:
            print("connected", flush=True)
            if "go_file" in spec:  # a start barrier across processes, set by the test
                go = Path(spec["go_file"])
                while not go.exists():
                    time.sleep(0.01)
            result = client.average(
                tensors,
                key=spec["key"],
                weight=spec.get("weight", 1.0),
                group_size=spec.get("group_size"),
                min_group_size=spec.get("min_group_size", 2),
                timeout=spec.get("timeout", 30.0),
            )
        np.savez(out.with_suffix(".npz"), *result.tensors)
        record = {
            "ok": True,
            "group_size": result.group_size,
            "peers": result.peers,
            "group_id": result.group_id,
            "partial": result.partial,
            "local_callers": result.local_callers,
        }
    except SwarmError as exc:
        record = {"ok": False, "error": type(exc).__name__, "message": str(exc)}
    record["elapsed"] = time.monotonic() - started
    out.with_suffix(".json").write_text(json.dumps(record))
    print("outcome written", file=sys.stderr, flush=True)  # a hang after this is the exit's
    return 0


if __name__ == "__main__":
    sys.exit(main(json.loads(sys.argv[1])))
