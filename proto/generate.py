"""Regenerate the committed protobuf and gRPC code from the `.proto` files.

Run ``python -m swarmavg.proto.generate`` (needs the ``dev`` extra for grpcio-tools).
The `.proto` files are compiled with the include root mapped to ``swarmavg/proto`` so
that generated imports read ``from swarmavg.proto import x_pb2`` and resolve inside
the installed namespace (``swarmavg.proto``).
"""

from __future__ import annotations

import shutil
import sys
import tempfile
from pathlib import Path

PROTO_DIR = Path(__file__).resolve().parent


def generate(out_dir: Path) -> list[Path]:
    """Compile every `.proto` in this folder into ``out_dir``; return the files written."""
    from grpc_tools import protoc  # imported lazily: a dev-only dependency

    sources = sorted(PROTO_DIR.glob("*.proto"))
    with tempfile.TemporaryDirectory() as tmp:
        args = [
            "grpc_tools.protoc",
            f"-Iswarmavg/proto={PROTO_DIR}",
            f"--python_out={tmp}",
            f"--pyi_out={tmp}",
            f"--grpc_python_out={tmp}",
            *(f"swarmavg/proto/{src.name}" for src in sources),
        ]
        if protoc.main(args) != 0:
            raise RuntimeError(f"protoc failed on {[s.name for s in sources]}")
        written = []
        for produced in sorted((Path(tmp) / "swarmavg" / "proto").iterdir()):
            target = out_dir / produced.name
            shutil.copyfile(produced, target)
            written.append(target)
    return written


def main() -> int:
    for path in generate(PROTO_DIR):
        print(path.relative_to(PROTO_DIR.parent))
    return 0


if __name__ == "__main__":
    sys.exit(main())
