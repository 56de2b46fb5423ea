"""Private runs: the round time with TLS on vs off, A/B in one run.

Starts swarms side by side on loopback, each of N real ``swarmavg peer`` daemons (CLI)
with one client process per daemon (benchmarks/rounds.py's ``Swarm`` and workers): "plain",
a public run (insecure gRPC, plain TCP data plane), and "tls", a private run whose daemons
were invited by a run authority made here (mutual TLS 1.3 on the gRPC port and the data
plane); ``--swarms`` adds "plain-grpc" and "tls-grpc", the same two with the data plane off
(``--data-port -1``: Reduce streams over gRPC, TLS by grpcio's BoringSSL). Round by round
the swarms take turns (the order reverses every round), so the machine's drifting load
weighs on all alike; the idle swarms only wait. Each figure is the median
over ``--rounds`` rounds after one untimed warm-up round each; results are checked against
the exact mean (rounds.py's check). Besides the round time it reports the CPU seconds the N
daemons spent per round (``/proc/PID/stat``, all threads), which is what TLS adds and which a
loaded machine inflates far less than wall time. Prints ONE JSON line; progress on stderr.

    python -m benchmarks.tls_rounds --peers 4 --mb 64 --rounds 7
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from swarmavg.dht.credentials import (
    JoinRequest,
    init_run,
    invite,
    load_or_create_tls_key,
    tls_key_path,
)
from swarmavg.dht.identity import Identity

from . import rounds  # the loopback swarm, one round, the summary
from .common import cpu_seconds


def invite_members(folder: Path, run_id: str, n: int) -> list[list[str]]:
    """A run authority in ``folder`` and ``n`` invited members: their ``swarmavg peer`` flags."""
    folder.mkdir(parents=True)
    authority, run_file = folder / "authority.pem", folder / "run.toml"
    init_run(run_id, authority, run_file)
    flags = []
    for i in range(n):
        identity_path = folder / f"m{i}.key"
        identity = Identity.load_or_create(identity_path)
        request = JoinRequest.make(identity, load_or_create_tls_key(tls_key_path(identity_path)))
        _, credential = invite(authority, run_file, request.encode())
        credential_path = folder / f"m{i}.cred.pem"
        credential_path.write_bytes(credential)
        flags.append(
            [
                *("--run-file", str(run_file)),
                *("--credential", str(credential_path)),
                *("--identity", str(identity_path)),
            ]
        )
    return flags


VARIANTS = {
    # name: (private run?, extra `swarmavg peer` flags)
    "plain": (False, []),
    "tls": (True, []),
    "plain-grpc": (False, ["--data-port", "-1"]),  # no data plane: Reduce over gRPC
    "tls-grpc": (True, ["--data-port", "-1"]),  # the same through grpcio's TLS (BoringSSL)
}


def bench(n: int, args: argparse.Namespace, workdir: Path) -> dict[str, Any]:
    elements = int(args.mb * 1e6) // 4
    run_id = f"tls-{os.getpid()}-{n}"
    credentials = invite_members(workdir / f"authority{n}", run_id, n)
    names = [v for v in args.swarms.split(",") if v]
    if "plain" not in names or any(v not in VARIANTS for v in names):
        raise SystemExit(f"--swarms: 'plain' and any of {sorted(VARIANTS)}")
    swarms: dict[str, rounds.Swarm] = {}
    try:
        for name in names:
            private, extra = VARIANTS[name]
            swarms[name] = rounds.Swarm(
                n,
                elements,
                workdir / f"{name}{n}",
                args.daemon_log_level,
                daemon_flags=lambda i, p=private, e=extra: (credentials[i] if p else []) + e,
                # private swarms share the invited run (their own bootstraps keep them apart)
                run_id=run_id if private else f"{run_id}-{name}",
            )
        measured: dict[str, list[dict[str, Any]]] = {name: [] for name in swarms}
        warmups: dict[str, dict[str, Any]] = {}
        for r in range(args.rounds + 1):  # round 0 warms up each swarm
            order = names if r % 2 == 0 else names[::-1]
            for name in order:
                pids = [d.proc.pid for d in swarms[name].daemons]
                cpu_before = cpu_seconds(pids)
                outcome = rounds.one_round(swarms[name], f"r{r}", args.codec, n, args.timeout)
                outcome["daemon_cpu_s"] = cpu_seconds(pids) - cpu_before
                rounds.log(
                    f"N={n} {name} round {r}: slowest {outcome['slowest']:.3f} s, "
                    f"median {outcome['median']:.3f} s, daemon CPU {outcome['daemon_cpu_s']:.2f} s"
                    + (f", errors {outcome['errors']}" if outcome["errors"] else "")
                )
                if r == 0:
                    warmups[name] = outcome
                else:
                    measured[name].append(outcome)
        figures = {
            name: rounds.summarize(measured[name], warmups[name], args.codec) for name in swarms
        }
        for name in swarms:
            cpu = [r["daemon_cpu_s"] for r in measured[name]]
            figures[name]["daemon_cpu_s"] = rounds._med(cpu)
            figures[name]["daemon_cpu_all"] = [round(c, 3) for c in cpu]
        plain = figures["plain"]
        ratios: dict[str, Any] = {}
        for name in names[1:]:
            other = figures[name]
            per_round = [
                t["slowest"] / p["slowest"]
                for p, t in zip(measured["plain"], measured[name], strict=True)
                if not p["errors"] and not t["errors"]
            ]
            ratios[f"{name}/plain (slowest)"] = rounds._ratio(
                other["slowest_s"], plain["slowest_s"]
            )
            ratios[f"{name}/plain (worker median)"] = rounds._ratio(
                other["median_s"], plain["median_s"]
            )
            ratios[f"{name}/plain per round, median"] = rounds._med(per_round)
            ratios[f"{name}/plain daemon CPU"] = rounds._ratio(
                other["daemon_cpu_s"], plain["daemon_cpu_s"]
            )
        return {"peers": n, "codec": args.codec, **figures, "ratios": ratios}
    finally:
        for swarm in swarms.values():
            swarm.close()


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="4")
    parser.add_argument("--mb", type=float, default=64.0, help="MB (1e6 bytes) of float32")
    parser.add_argument("--rounds", type=int, default=7, help="timed rounds per swarm")
    parser.add_argument("--codec", default="none")
    parser.add_argument(
        "--swarms",
        default="plain,tls",
        help=f"comma-separated, 'plain' first: any of {', '.join(VARIANTS)} "
        "(-grpc: the daemons run with --data-port -1, so Reduce streams go over gRPC)",
    )
    parser.add_argument("--timeout", type=float, default=rounds.CALL_TIMEOUT)
    parser.add_argument("--daemon-log-level", default="WARNING")
    parser.add_argument(
        "--log-dir", default=None, help="keep the daemons' logs here (default: discarded)"
    )
    args = parser.parse_args()
    figures: dict[str, Any] = {
        "benchmark": "tls_rounds",
        "path": "swarmavg peer daemons (CLI) + one client process each, loopback; "
        "public run vs private run (mutual TLS), interleaved",
        "mb": args.mb,
        "rounds": args.rounds,
        "load_average_at_start": round(os.getloadavg()[0], 2),
        "cpu_cores": os.cpu_count(),
        "configs": [],
    }
    status = 0
    workdir = Path(tempfile.mkdtemp(prefix="tls-", dir="/tmp"))  # short: socket paths
    started = time.monotonic()
    try:
        for n in (int(x) for x in args.peers.split(",") if x):
            figures["configs"].append(bench(n, args, workdir))
    except KeyboardInterrupt:
        figures["error"] = "interrupted"
        status = 130
    except Exception as exc:  # the line still comes out, with what was measured
        figures["error"] = f"{type(exc).__name__}: {exc}"
        rounds.log(f"failed: {exc!r}")
        status = 1
    finally:
        if args.log_dir:
            shutil.copytree(
                workdir, args.log_dir, dirs_exist_ok=True, ignore=shutil.ignore_patterns("*.sock")
            )
        shutil.rmtree(workdir, ignore_errors=True)
    figures["seconds"] = round(time.monotonic() - started, 1)
    figures["load_average_at_end"] = round(os.getloadavg()[0], 2)
    print(json.dumps(figures), flush=True)
    return status


if __name__ == "__main__":
    sys.exit(main())
