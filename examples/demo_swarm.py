"""A local demo swarm: 4 `swarmavg peer` daemons and 4 training processes (``make demo``).

Starts four real daemons on 127.0.0.1 (the first starts a new swarm, the others ``--join``
it), then four client processes that each average their own random "gradients" with the
others for a few rounds, each checking its result against the exact weighted mean.
Everything is shut down at the end, and also on Ctrl+C. Takes about 10-20 seconds.
"""

from __future__ import annotations

import contextlib
import json
import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

PEERS = 4
ROUNDS = 3
SHAPES = [(256, 512), (512,), (64, 64)]
READY_TIMEOUT = 30.0


def tensors_for(client: int, step: int) -> list[Any]:
    import numpy as np

    rng = np.random.default_rng(1000 * step + client)
    return [rng.standard_normal(shape).astype(np.float32) for shape in SHAPES]


def run_client(index: int, control: str) -> int:
    """One training process: average with the swarm for ROUNDS steps."""
    import numpy as np

    from swarmavg.peer import SwarmError, connect

    weights = [float(i + 1) for i in range(PEERS)]  # e.g. samples processed by each peer
    with connect(control) as client:
        for step in range(ROUNDS):
            mine = tensors_for(index, step)
            started = time.monotonic()
            try:
                result = client.average(
                    mine,
                    key=f"demo-step-{step}",
                    weight=weights[index],
                    group_size=PEERS,
                    min_group_size=PEERS,
                    timeout=20.0,
                )
            except SwarmError as exc:
                print(f"  client {index} step {step}: {type(exc).__name__}: {exc}", flush=True)
                return 1
            everyone = [tensors_for(i, step) for i in range(PEERS)]
            error = max(
                float(
                    np.abs(
                        got
                        - sum(w * x[t] for w, x in zip(weights, everyone, strict=True))
                        / sum(weights)
                    ).max()
                )
                for t, got in enumerate(result.tensors)
            )
            print(
                f"  client {index} step {step}: averaged {sum(t.size for t in mine):,} values "
                f"with {result.group_size} peers in {time.monotonic() - started:.2f} s, "
                f"max |result - exact weighted mean| = {error:.1e}",
                flush=True,
            )
    return 0


class Daemon:
    """A `swarmavg peer` subprocess whose JSON ready line has been read."""

    def __init__(self, control: Path, join: str | None, registry: list[Daemon]) -> None:
        args = [sys.executable, "-m", "swarmavg.peer.cli", "peer", "--listen", "127.0.0.1:0"]
        args += ["--control", str(control), "--run-id", "demo", "--log-level", "WARNING"]
        if join:
            args += ["--join", join]
        # A session of its own: Ctrl+C reaches only this script, which stops the daemon
        # with exactly one SIGTERM (a second signal would make it exit without cleaning up).
        self.proc = subprocess.Popen(
            args, stdout=subprocess.PIPE, text=True, start_new_session=True
        )
        registry.append(self)  # stopped by main() even if the ready line never comes
        lines: queue.Queue[str] = queue.Queue()
        assert self.proc.stdout is not None
        stdout = self.proc.stdout
        threading.Thread(target=lambda: [lines.put(x) for x in stdout], daemon=True).start()
        try:
            self.ready: dict[str, Any] = json.loads(lines.get(timeout=READY_TIMEOUT))
        except queue.Empty:
            raise RuntimeError(
                f"daemon gave no ready line (exit code {self.proc.poll()})"
            ) from None

    def stop(self) -> None:
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGTERM)  # graceful; silent if still importing
            try:
                self.proc.wait(timeout=8)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.proc.stdout is not None:
            self.proc.stdout.close()


def _interrupt(signum: int, frame: Any) -> None:
    raise KeyboardInterrupt


def main() -> int:
    # Ctrl+C (and SIGTERM) must always stop the demo, even when started with SIGINT ignored.
    signal.signal(signal.SIGINT, _interrupt)
    signal.signal(signal.SIGTERM, _interrupt)
    daemons: list[Daemon] = []
    clients: list[subprocess.Popen[bytes]] = []
    started = time.monotonic()
    with tempfile.TemporaryDirectory(prefix="swarmavg-demo-", dir="/tmp") as workdir:
        try:
            print(f"starting {PEERS} peer daemons ...", flush=True)
            for i in range(PEERS):
                join = daemons[0].ready["address"] if daemons else None
                Daemon(Path(workdir) / f"peer{i}.sock", join, daemons)
                d = daemons[-1].ready
                how = "new swarm" if join is None else f"joined {join}"
                print(f"  peer {i}: {d['peer_id'][:12]} at {d['address']} ({how})", flush=True)
            print(f"{PEERS} training processes average for {ROUNDS} steps ...", flush=True)
            for i, daemon in enumerate(daemons):
                clients.append(
                    subprocess.Popen(
                        [sys.executable, __file__, "--client", str(i), daemon.ready["control"]],
                        start_new_session=True,
                    )
                )
            failed = sum(1 for c in clients if c.wait(timeout=120) != 0)
            from swarmavg.peer import connect

            with connect(daemons[0].ready["control"]) as client:
                status = client.status()
            print(
                f"peer 0 status: {status['known_peers'] + 1} peers, "
                f"{status['rounds_done']} rounds done, {status['rounds_failed']} failed, "
                f"{status['bytes_sent'] / 1e6:.1f} MB sent, "
                f"{status['bytes_received'] / 1e6:.1f} MB received",
                flush=True,
            )
            print(f"done in {time.monotonic() - started:.1f} s", flush=True)
            return 1 if failed else 0
        except KeyboardInterrupt:
            print("\ninterrupted: stopping the swarm ...", flush=True)
            return 130
        finally:
            for c in clients:
                if c.poll() is None:
                    c.terminate()
                with contextlib.suppress(subprocess.TimeoutExpired):
                    c.wait(timeout=5)
            for daemon in daemons:
                daemon.stop()
            print("all processes stopped", flush=True)


if __name__ == "__main__":
    if len(sys.argv) == 4 and sys.argv[1] == "--client":
        with contextlib.suppress(KeyboardInterrupt):
            sys.exit(run_client(int(sys.argv[2]), sys.argv[3]))
        sys.exit(130)
    os.environ.setdefault("PYTHONUNBUFFERED", "1")
    sys.exit(main())
