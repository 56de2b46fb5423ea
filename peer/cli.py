"""The ``swarmavg`` command line (DESIGN section 3.1)."""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence

from swarmavg.peer import __version__


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="swarmavg",
        description="Decentralized peer-to-peer tensor averaging for collaborative deep learning.",
    )
    parser.add_argument("--version", action="version", version=f"swarmavg {__version__}")
    parser.add_subparsers(dest="command", metavar="COMMAND")
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.command is None:
        parser.print_help()
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())
