"""The codec work of an all-reduce round, before and after, in one process.

Per codec, on 8 M float32 normal values cut into chunks of 256 K elements (as the
all-reduce calls the codecs), seconds for the whole vector:

- ``before_encode``, ``before_decode``, ``before_values``: the ``compression`` package
  as it was at ``--before`` (loaded side by side from ``git show``):
  ``encode_payload`` alone, ``decode_payload`` alone, and both in a row (what the
  reducer did for each averaged chunk and for the round trip of its own part);
- ``encode``, ``decode``: the same with the working tree's kernels;
- ``default_values``: the working tree's ``Codec.encode_payload_and_values`` default
  (``encode_payload`` then ``decode_payload``);
- ``values``: ``encode_payload_and_values``; ``round_trip``: ``round_trip``.

Each figure is the median of ``--repeats`` runs, timed as the thread's CPU time (less
disturbed by other processes on shared cores than wall time), the variants interleaved
so that ratios compare runs made at the same moment. Prints ONE JSON line.

    python benchmarks/codec_roundtrip.py --before 13e93d5 --repeats 9
"""

from __future__ import annotations

import argparse
import importlib
import json
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from pathlib import Path
from types import ModuleType

import numpy as np

from swarmavg.compression import CodecInfo, get_codec
from swarmavg.compression.base import Codec

ROOT = Path(__file__).resolve().parents[1]
CHUNK = 1 << 18
CODECS = ["float16", "uint8-blockwise", "bfloat16", "scaled-float16"]


def load_before(revision: str, directory: Path) -> ModuleType:
    """The ``compression`` package at ``revision``, importable as
    ``swarmavg_before.compression`` (its own registry, its own kernels)."""

    def git(*args: str) -> str:
        return subprocess.run(
            ["git", "-C", str(ROOT), *args], check=True, capture_output=True, text=True
        ).stdout

    package = directory / "swarmavg_before" / "compression"
    package.mkdir(parents=True)
    (package.parent / "__init__.py").write_text("")
    for path in git("ls-tree", "--name-only", revision, "compression/").split():
        if path.endswith(".py"):
            source = git("show", f"{revision}:{path}")
            source = source.replace("swarmavg.compression", "swarmavg_before.compression")
            (package / Path(path).name).write_text(source)
    sys.path.insert(0, str(directory))
    return importlib.import_module("swarmavg_before.compression")


def _variants(
    codec: Codec, before: Codec | None, chunks: list[np.ndarray]
) -> dict[str, Callable[[], None]]:
    info = CodecInfo(key="bench", finite=True)
    encoded = [codec.encode_payload(c, info) for c in chunks]
    out: dict[str, Callable[[], None]] = {}
    if before is not None:
        old = before
        old_info = type(old).encode_payload.__globals__["CodecInfo"](key="bench", finite=True)
        old_encoded = [old.encode_payload(c, old_info) for c in chunks]

        def before_encode() -> None:
            for c in chunks:
                old.encode_payload(c, old_info)

        def before_decode() -> None:
            for e in old_encoded:
                old.decode_payload(e.header, e.payload)

        def before_values() -> None:
            for c in chunks:
                e = old.encode_payload(c, old_info)
                old.decode_payload(e.header, e.payload)

        out |= {
            "before_encode": before_encode,
            "before_decode": before_decode,
            "before_values": before_values,
        }

    def encode() -> None:
        for c in chunks:
            codec.encode_payload(c, info)

    def decode() -> None:
        for e in encoded:
            codec.decode_payload(e.header, e.payload)

    def default_values() -> None:
        for c in chunks:
            Codec.encode_payload_and_values(codec, c, info)

    def values() -> None:
        for c in chunks:
            codec.encode_payload_and_values(c, info)

    def round_trip() -> None:
        for c in chunks:
            codec.round_trip(c, info)

    return out | {
        "encode": encode,
        "decode": decode,
        "default_values": default_values,
        "values": values,
        "round_trip": round_trip,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 23)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--before", default=None, help="git revision to compare against")
    args = parser.parse_args()
    x = np.random.default_rng(0).standard_normal(args.elements).astype(np.float32)
    chunks = [x[i : i + CHUNK] for i in range(0, x.size, CHUNK)]
    result: dict[str, object] = {
        "benchmark": "codec_roundtrip",
        "elements": args.elements,
        "chunk": CHUNK,
        "repeats": args.repeats,
        "before": args.before,
        "unit": "thread CPU seconds for the whole vector, median",
    }
    with tempfile.TemporaryDirectory() as tmp:
        old = load_before(args.before, Path(tmp)) if args.before else None
        for name in args.codecs.split(","):
            before = old.get_codec(name) if old is not None else None
            variants = _variants(get_codec(name), before, chunks)
            times: dict[str, list[float]] = {k: [] for k in variants}
            for fn in variants.values():
                fn()  # warm-up: lookup tables, page faults
            for _ in range(args.repeats):
                for key, fn in variants.items():
                    t0 = time.thread_time()
                    fn()
                    times[key].append(time.thread_time() - t0)
            med = {k: statistics.median(v) for k, v in times.items()}
            figures: dict[str, float] = {k: round(v, 4) for k, v in med.items()}
            base = med.get("before_values", med["default_values"])
            figures["values_speedup"] = round(base / med["values"], 2)
            figures["round_trip_speedup"] = round(base / med["round_trip"], 2)
            if "before_encode" in med:
                figures["encode_speedup"] = round(med["before_encode"] / med["encode"], 2)
                figures["decode_speedup"] = round(med["before_decode"] / med["decode"], 2)
            result[name] = figures
    print(json.dumps(result))


if __name__ == "__main__":
    main()
