"""``swarmavg monitor``'s command line (the monitor itself: :mod:`swarmavg.peer.monitor`)."""

from __future__ import annotations

import argparse
import os
from pathlib import Path

from swarmavg.peer.monitor.series import DEFAULT_HISTORY


def add_monitor_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from swarmavg.peer.monitor.monitor import DEFAULT_HTTP, DEFAULT_INTERVAL

    monitor = sub.add_parser(
        "monitor",
        help="record a run over time (CSV, TensorBoard, wandb) and serve a dashboard",
        description="Join a run's DHT as a light peer (client mode, no averaging), read every "
        "trainer's progress records every few seconds, record peers, epoch, samples/s, "
        "ETA and the metrics trainers report (opt.report_metrics) to CSV, TensorBoard or "
        "wandb, and serve a web page that plots them.",
    )
    monitor.add_argument(
        "--run-id", metavar="NAME", help="the run to watch (default: $SWARMAVG_RUN_ID)"
    )
    monitor.add_argument(
        "--initial-peers",
        "--join",
        dest="join",
        metavar="ADDR",
        action="append",
        default=[],
        help="a peer or bootstrap node of the run, HOST:PORT; repeatable or comma-separated "
        "(default: $SWARMAVG_JOIN)",
    )
    monitor.add_argument(
        "--training-run",
        metavar="NAME",
        default="",
        help="the run id the trainers report progress under, when it differs from --run-id",
    )
    monitor.add_argument(
        "--interval",
        type=float,
        default=DEFAULT_INTERVAL,
        metavar="SECONDS",
        help=f"seconds between polls (default {DEFAULT_INTERVAL:g})",
    )
    monitor.add_argument(
        "--history",
        type=int,
        default=DEFAULT_HISTORY,
        metavar="N",
        help=f"samples the dashboard keeps (default {DEFAULT_HISTORY}; the logs keep all)",
    )
    monitor.add_argument("--csv", type=Path, metavar="FILE", help="append every sample to FILE")
    monitor.add_argument(
        "--tensorboard", type=Path, metavar="DIR", help="write TensorBoard scalars to DIR"
    )
    monitor.add_argument(
        "--wandb", action="store_true", help="log to Weights & Biases (needs wandb installed)"
    )
    monitor.add_argument(
        "--wandb-project",
        metavar="NAME",
        default="swarmavg",
        help="the wandb project (default swarmavg; the wandb run is named after the run id)",
    )
    dashboard = monitor.add_mutually_exclusive_group()
    dashboard.add_argument(
        "--http",
        metavar="HOST:PORT",
        default=DEFAULT_HTTP,
        help=f"serve the dashboard here (default {DEFAULT_HTTP}; port 0 picks a free one; "
        "0.0.0.0:PORT shows it to the network)",
    )
    dashboard.add_argument("--no-http", action="store_true", help="serve no dashboard")
    monitor.add_argument(
        "--bootstrap-timeout",
        type=float,
        default=30.0,
        metavar="SECONDS",
        help="seconds to retry the initial peers before giving up (default 30)",
    )
    monitor.add_argument(
        "--log-level", default="INFO", metavar="LEVEL", help="logging level (default INFO)"
    )
    private = monitor.add_argument_group(
        "private runs",
        "a monitor of a private run needs an invitation like any peer (docs/private-runs.md)",
    )
    private.add_argument(
        "--run-file",
        metavar="FILE",
        help="the private run's run file (swarmavg run init); names the run, so --run-id "
        "may be left out (default: $SWARMAVG_RUN_FILE)",
    )
    private.add_argument(
        "--credential",
        metavar="FILE",
        help="the monitor's credential in the run (swarmavg run invite) "
        "(default: $SWARMAVG_CREDENTIAL)",
    )
    private.add_argument(
        "--revocations",
        metavar="FILE",
        help="the run's revocation list (swarmavg run revoke): refuse the peers it names "
        "(default: $SWARMAVG_REVOCATIONS)",
    )
    private.add_argument(
        "--identity",
        metavar="FILE",
        help="the Ed25519 identity the credential was issued for (swarmavg run whoami); "
        "in a public run, a fixed peer id for the monitor (default: $SWARMAVG_IDENTITY)",
    )


def cmd_monitor(args: argparse.Namespace) -> int:
    from swarmavg.peer.cli.process import EXIT_USAGE, report_error, run_loop, serve
    from swarmavg.peer.daemon.config import split_addresses
    from swarmavg.peer.logs import setup_daemon_logging
    from swarmavg.peer.monitor.monitor import Monitor, MonitorSettings

    join = args.join or split_addresses(os.environ.get("SWARMAVG_JOIN", ""))
    run_file = args.run_file or os.environ.get("SWARMAVG_RUN_FILE") or None
    credential = args.credential or os.environ.get("SWARMAVG_CREDENTIAL") or None
    identity = args.identity or os.environ.get("SWARMAVG_IDENTITY") or None
    revocations = args.revocations or os.environ.get("SWARMAVG_REVOCATIONS") or None
    try:
        run_id = args.run_id or os.environ.get("SWARMAVG_RUN_ID") or run_file_run(run_file)
    except ValueError as exc:
        report_error("monitor", str(exc))
        return EXIT_USAGE
    if not run_id:
        report_error("monitor", "which run? give --run-id NAME (or set SWARMAVG_RUN_ID)")
        return EXIT_USAGE
    try:
        settings = MonitorSettings(
            run_id=run_id,
            join=join,
            training_run=args.training_run,
            interval=args.interval,
            history=args.history,
            http=None if args.no_http else args.http,
            csv=args.csv,
            tensorboard=args.tensorboard,
            wandb_project=args.wandb_project if args.wandb else None,
            bootstrap_timeout=args.bootstrap_timeout,
            log_level=args.log_level,
            identity=identity,
            run_file=run_file,
            credential=credential,
            revocations=revocations,
        )
    except ValueError as exc:
        report_error("monitor", str(exc))
        return EXIT_USAGE
    setup_daemon_logging(settings.peer_config.log_level)
    return run_loop(serve(Monitor(settings), "monitor"))


def run_file_run(run_file: str | None) -> str:
    """The run a private run's file names ("" without one), as ``swarmavg peer`` reads it.

    Raises:
        ValueError: the file cannot be read or is not a run file (the message says which).
    """
    if run_file is None:
        return ""
    from swarmavg.dht.credentials import CredentialError, read_run_id

    try:
        return read_run_id(run_file)
    except CredentialError as exc:
        raise ValueError(str(exc)) from None
