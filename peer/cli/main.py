"""The ``swarmavg`` command line (docs/peer.md).

``swarmavg peer`` runs a daemon in the foreground, ``swarmavg dht`` a bare DHT node,
``swarmavg status`` asks a running daemon for its figures, ``swarmavg peers`` for every peer of
its run, ``swarmavg monitor`` records a run over time and plots it (``peer/cli/monitor.py``),
``swarmavg run`` creates a private run's authority and invites its peers
(``peer/cli/run.py``), ``swarmavg launch`` runs a training command beside a daemon of its
own (``peer/cli/launch.py``). The daemon prints exactly one
JSON line on stdout once it is ready; everything else (logs, errors) goes to stderr.
Heavy modules are imported only by the subcommand that needs them, so ``--help`` is fast
and the daemon never loads torch.
"""

from __future__ import annotations

import argparse
import difflib
import json
import logging
import os
import sys
from collections.abc import Sequence

from swarmavg.peer.cli.process import (
    EXIT_FORCED,
    EXIT_STARTUP,
    EXIT_USAGE,
    Daemon,
    report_error,
    run_loop,
    serve,
)
from swarmavg.peer.daemon.config import PeerConfig
from swarmavg.peer.daemon.settings import (
    CONFIG_ENV,
    add_flags,
    flags_from_args,
    resolve_config,
    unknown_env,
)
from swarmavg.peer.logs import setup_daemon_logging
from swarmavg.peer.version import installed_version


class _VersionAction(argparse.Action):
    """``--version``: argparse's own action takes the version string when the parser is
    built, which every start does; this one reads it only when asked (peer/version.py)."""

    def __init__(self, option_strings: Sequence[str], dest: str) -> None:
        super().__init__(
            option_strings, dest=argparse.SUPPRESS, nargs=0, help="show the version and exit"
        )

    def __call__(
        self,
        parser: argparse.ArgumentParser,
        namespace: argparse.Namespace,
        values: object,
        option_string: str | None = None,
    ) -> None:
        print(f"swarmavg {installed_version()}")
        parser.exit()


def _add_daemon_flags(parser: argparse.ArgumentParser, command: str) -> None:
    add_flags(parser, command)
    parser.add_argument(
        "--config", metavar="FILE.toml", help=f"TOML config file (env {CONFIG_ENV})"
    )
    loudness = parser.add_mutually_exclusive_group()
    loudness.add_argument(
        "-v", "--verbose", action="store_true", help="log at DEBUG (same as --log-level DEBUG)"
    )
    loudness.add_argument(
        "-q", "--quiet", action="store_true", help="log warnings and errors only (WARNING)"
    )


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmavg",
        description="Decentralized peer-to-peer tensor averaging for collaborative deep learning.",
    )
    parser.add_argument("--version", action=_VersionAction)
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    peer = sub.add_parser(
        "peer",
        help="run a peer daemon in the foreground",
        description="Run a peer daemon until SIGINT/SIGTERM (a second signal exits at once). "
        "Precedence: flag > env var > config file > default.",
    )
    _add_daemon_flags(peer, "peer")
    launch = sub.add_parser(
        "launch",
        help="run a training command beside a daemon of its own (torchrun-style)",
        usage="swarmavg launch [peer options] -- COMMAND [ARGS ...]",
        description="Start a daemon with the peer options, run COMMAND with SWARMAVG_CONTROL "
        "set to it, forward Ctrl+C/SIGTERM to COMMAND, stop the daemon when COMMAND ends "
        "and exit with COMMAND's code. Several launches on one machine (one per GPU) "
        "each get their own daemon, control socket and port.",
    )
    _add_daemon_flags(launch, "peer")
    launch.add_argument(
        "training_command", nargs="*", metavar="-- COMMAND", help="what to run, after --"
    )
    dht = sub.add_parser(
        "dht",
        help="run a bare DHT node (a long-lived bootstrap peer)",
        description="Run a DHT node without an averager, e.g. a bootstrap peer for a public run.",
    )
    _add_daemon_flags(dht, "dht")
    status = sub.add_parser("status", help="show a running daemon's figures")
    _add_endpoint_flags(status)
    peers = sub.add_parser(
        "peers",
        help="show every peer of the run: address, mode, epoch, samples/s, last seen",
        description="Ask a running daemon for every peer of its run (progress records read "
        "through the DHT, addresses from its routing table) and the run's epoch, "
        "samples/s and time to the next global step.",
    )
    _add_endpoint_flags(peers)
    peers.add_argument(
        "--training-run",
        metavar="NAME",
        help="the run id the trainers report progress under, when it differs from the "
        "daemon's (default: the daemon's run id)",
    )
    from swarmavg.peer.cli.monitor import add_monitor_parser
    from swarmavg.peer.cli.run import add_run_parser

    add_monitor_parser(sub)
    add_run_parser(sub)
    return parser


def _add_endpoint_flags(parser: argparse.ArgumentParser) -> None:
    """``--run-id | --control`` and ``--json``: which daemon to ask, how to answer."""
    which = parser.add_mutually_exclusive_group()
    which.add_argument(
        "--run-id",
        metavar="NAME",
        help="the run whose daemon to ask, at its default socket (default: $SWARMAVG_RUN_ID)",
    )
    which.add_argument(
        "--control",
        metavar="ENDPOINT",
        help="the daemon's control endpoint (default: $SWARMAVG_CONTROL; with neither this "
        "nor a run id, the one daemon of this user on a default socket)",
    )
    parser.add_argument("--json", action="store_true", help="print one JSON object")


def _config_from_args(args: argparse.Namespace) -> PeerConfig:
    flags = flags_from_args(args, args.command)
    if args.verbose or args.quiet:
        if flags.get("log_level") is not None:
            raise ValueError("give either --log-level or -v/-q, not both")
        flags["log_level"] = "DEBUG" if args.verbose else "WARNING"
    return resolve_config(flags, os.environ, args.config)


def cmd_daemon(args: argparse.Namespace) -> int:
    try:
        config = _config_from_args(args)
    except ValueError as exc:
        report_error(args.command, str(exc))
        return EXIT_USAGE
    setup_daemon_logging(config.log_level)
    for warning in unknown_env(os.environ):
        logging.getLogger("swarmavg.peer.cli").warning("%s", warning)
    if args.command == "peer":
        from swarmavg.peer.daemon.daemon import Peer
        from swarmavg.peer.daemon.heap import keep_freed_memory

        keep_freed_memory()  # rounds reuse the memory they free instead of faulting it in

        daemon: Daemon = Peer(config)
    else:
        from swarmavg.peer.daemon.bare_dht import BareDHT

        try:
            daemon = BareDHT(config)
        except ValueError as exc:
            report_error(args.command, str(exc))
            return EXIT_USAGE
    return run_loop(serve(daemon, args.command))


def cmd_status(args: argparse.Namespace) -> int:
    from swarmavg.peer.cli.status import format_status
    from swarmavg.peer.client.client import connect, resolve_endpoint
    from swarmavg.peer.client.errors import SwarmError

    try:
        endpoint = resolve_endpoint(args.control, args.run_id)
        with connect(str(endpoint), use_shm=False) as client:
            figures = client.status()
    except SwarmError as exc:
        report_error("status", str(exc))
        return EXIT_STARTUP
    if args.json:
        print(json.dumps(figures, sort_keys=True))
    else:
        print(format_status(figures))
    return 0


def cmd_peers(args: argparse.Namespace) -> int:
    from swarmavg.peer.cli.peers_table import format_peers
    from swarmavg.peer.client.client import connect, resolve_endpoint
    from swarmavg.peer.client.errors import SwarmError

    try:
        endpoint = resolve_endpoint(args.control, args.run_id)
        with connect(str(endpoint), use_shm=False) as client:
            view = client.peers(args.training_run)
    except SwarmError as exc:
        report_error("peers", str(exc))
        return EXIT_STARTUP
    if args.json:
        print(json.dumps(view, sort_keys=True))
    else:
        print(format_peers(view))
    return 0


def parse_arguments(parser: argparse.ArgumentParser, argv: Sequence[str]) -> argparse.Namespace:
    """``parser.parse_args(argv)``, whose error for an unknown flag names the likely one."""
    args, unknown = parser.parse_known_args(argv)
    if unknown:
        command = _subparser(parser, args.command) or parser
        command.error(unknown_arguments_message(unknown, _option_strings(command)))
    return args


def unknown_arguments_message(unknown: Sequence[str], options: Sequence[str]) -> str:
    """argparse's "unrecognized arguments" line, with the flag each unknown one most likely
    meant (``--run_id`` -> ``--run-id``, ``--bootstrap-timout`` -> ``--bootstrap-timeout``)."""
    message = f"unrecognized arguments: {' '.join(unknown)}"
    hints = []
    for arg in unknown:
        if not arg.startswith("-"):
            continue
        flag = arg.split("=", 1)[0]
        close = difflib.get_close_matches(flag.replace("_", "-"), options, n=1, cutoff=0.75)
        if close:
            hints.append(f"did you mean {close[0]} (not {flag})?")
    return "; ".join([message, *hints])


def _subparser(
    parser: argparse.ArgumentParser, command: str | None
) -> argparse.ArgumentParser | None:
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction) and command is not None:
            found = action.choices.get(command)
            return found if isinstance(found, argparse.ArgumentParser) else None
    return None


def _option_strings(parser: argparse.ArgumentParser) -> list[str]:
    return [option for action in parser._actions for option in action.option_strings]


def cmd_launch(parser: argparse.ArgumentParser, argv: Sequence[str]) -> int:
    """``swarmavg launch [peer options] -- COMMAND``: the peer options are checked here as
    ``swarmavg peer`` checks them (a typo fails before anything starts)."""
    from swarmavg.peer.cli.launch import LaunchError, launch, split_command

    try:
        peer_options, command = split_command(argv)
    except ValueError as exc:
        if "-h" in argv or "--help" in argv:
            parser.parse_args(["launch", "--help"])
        report_error("launch", str(exc))
        return EXIT_USAGE
    parse_arguments(parser, ["launch", *peer_options])  # exits 2 with argparse's message
    try:
        return launch(peer_options, command)
    except LaunchError as exc:
        report_error("launch", str(exc))
        return EXIT_STARTUP
    except OSError as exc:
        report_error("launch", f"cannot run {command[0]}: {exc.strerror or exc}")
        return EXIT_STARTUP


def main(argv: Sequence[str] | None = None) -> int:
    """The console script (``swarmavg``). Ctrl+C before a daemon's own signal handlers are
    installed (e.g. while importing) exits quietly with status 130."""
    try:
        return _main(argv)
    except KeyboardInterrupt:
        return EXIT_FORCED


def _main(argv: Sequence[str] | None) -> int:
    parser = build_parser()
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["launch"]:
        return cmd_launch(parser, argv[1:])
    args = parse_arguments(parser, argv)
    if args.command is None:
        parser.print_help()
        return EXIT_USAGE
    if args.command == "status":
        return cmd_status(args)
    if args.command == "peers":
        return cmd_peers(args)
    if args.command == "monitor":
        from swarmavg.peer.cli.monitor import cmd_monitor

        return cmd_monitor(args)
    if args.command == "run":
        from swarmavg.peer.cli.run import cmd_run

        return cmd_run(args)
    return cmd_daemon(args)


if __name__ == "__main__":
    sys.exit(main())
