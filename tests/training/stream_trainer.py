"""A Streaming DiLoCo trainer in its own process, for tests that kill one.

``python -m tests.training.stream_trainer CONTROL SEED PEERS [RUN]``: connects to the daemon
at ``CONTROL``, builds the same model and :class:`StreamingDiLoCo` as the tests
(``streaming_setup.make_streaming``, trainers' run ``RUN``, default ``streaming_setup.RUN``),
prints the JSON ready line the test harness waits
for, waits until the swarm's progress names ``PEERS`` members (alone it would race ahead
through local syncs), then trains until it is killed, one line per sync applied.
"""

from __future__ import annotations

import json
import sys
import time

import torch

from swarmavg.peer import connect
from tests.training.helpers import batch
from tests.training.streaming_setup import RUN, make_model, make_streaming

JOIN_DEADLINE = 240.0
"""Seconds to wait for the other members (a deadline for a loaded machine)."""


def main() -> None:
    control, seed, peers = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    run_id = sys.argv[4] if len(sys.argv) > 4 else RUN
    model = make_model()
    with connect(control) as client:
        opt = make_streaming(model, client, run_id)
        print(json.dumps({"event": "ready", "epoch": opt.epoch}), flush=True)
        deadline = time.monotonic() + JOIN_DEADLINE
        while opt.tracker.refresh().num_peers < peers:
            if time.monotonic() > deadline:
                raise SystemExit(f"the swarm did not reach {peers} members in {JOIN_DEADLINE} s")
            time.sleep(0.05)  # DHT reads: the others announce themselves when built
        last = opt.epoch
        step = 0
        while True:  # until the test kills this process
            x, y = batch(seed + step)
            torch.nn.functional.mse_loss(model(x), y).backward()
            opt.step()
            opt.zero_grad()
            step += 1
            if opt.epoch != last:
                last = opt.epoch
                print(json.dumps({"event": "sync", "epoch": last}), flush=True)


if __name__ == "__main__":
    main()
