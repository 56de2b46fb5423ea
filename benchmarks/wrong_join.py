"""Time from a wrong ``--join`` to the daemon's error, for each kind of wrong address.

Runs ``swarmavg peer --join ADDR --bootstrap-timeout T`` as a real process against: a
closed port, a web server (HTTP/1), a silent listener (accepts, never answers) and a peer of
another run; measures process start to exit (Python's start-up included) and keeps the
error line. ``--repeat`` runs of each, interleaved; prints ONE JSON line with the median
seconds and the last error line per kind.

    python -m benchmarks.wrong_join --repeat 3 --bootstrap-timeout 10
"""

from __future__ import annotations

import argparse
import http.server
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

PEER = [sys.executable, "-m", "swarmavg.peer.cli", "peer", "--listen", "127.0.0.1:0"]


class _Quiet(http.server.BaseHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def run_peer(workdir: Path, join: str, timeout: float, run_id: str) -> tuple[float, str]:
    began = time.monotonic()
    where = ["--control", str(workdir / "w.sock"), "--run-id", run_id, "--join", join]
    result = subprocess.run(
        [*PEER, *where, "--bootstrap-timeout", str(timeout)],
        capture_output=True,
        text=True,
        timeout=timeout * 3 + 60,
        check=False,
    )
    seconds = time.monotonic() - began
    errors = [line for line in result.stderr.splitlines() if "error:" in line]
    return seconds, errors[-1] if errors else result.stderr[-300:]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeat", type=int, default=3)
    parser.add_argument("--bootstrap-timeout", type=float, default=10.0)
    opts = parser.parse_args()
    with tempfile.TemporaryDirectory(prefix="wrongjoin-") as tmp:
        work = Path(tmp)
        os.chmod(work, 0o700)
        with socket.socket() as closed:
            closed.bind(("127.0.0.1", 0))
            closed_port = closed.getsockname()[1]
        silent = socket.socket()
        silent.bind(("127.0.0.1", 0))
        silent.listen(64)
        web = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Quiet)
        threading.Thread(target=web.serve_forever, daemon=True).start()
        other = subprocess.Popen(
            [*PEER, "--control", str(work / "o.sock"), "--run-id", "their-run"],
            stdout=subprocess.PIPE,
            stderr=subprocess.DEVNULL,
        )
        assert other.stdout is not None
        other_address = json.loads(other.stdout.readline())["address"]
        kinds = {
            "closed_port": f"127.0.0.1:{closed_port}",
            "web_server": f"127.0.0.1:{web.server_address[1]}",
            "silent_port": f"127.0.0.1:{silent.getsockname()[1]}",
            "other_run": other_address,
        }
        seconds: dict[str, list[float]] = {kind: [] for kind in kinds}
        lines: dict[str, str] = {}
        try:
            for _ in range(opts.repeat):
                for kind, address in kinds.items():
                    took, line = run_peer(work, address, opts.bootstrap_timeout, "my-run")
                    seconds[kind].append(took)
                    lines[kind] = line
        finally:
            other.terminate()
            other.wait(timeout=30)
            web.shutdown()
            silent.close()
    print(
        json.dumps(
            {
                "benchmark": "wrong_join",
                "bootstrap_timeout_s": opts.bootstrap_timeout,
                "repeat": opts.repeat,
                "median_s": {k: round(statistics.median(v), 2) for k, v in seconds.items()},
                "error_line": lines,
            }
        )
    )


if __name__ == "__main__":
    main()
