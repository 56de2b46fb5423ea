"""The codec work of an all-reduce round, old path against new, in one process.

Per codec, on 8 M float32 normal values cut into chunks of 256 K elements (as the
all-reduce calls the codecs), times for the whole vector:

- ``encode``: ``encode_payload`` alone; ``decode``: ``decode_payload`` alone;
- ``old_values``: ``encode_payload`` then ``decode_payload`` (what the reducer did for its
  averaged chunks, and what the round trip of a member's own part did);
- ``new_values``: ``encode_payload_and_values``; ``new_round_trip``: ``round_trip``;

each the median of ``--repeats`` runs, measured as the thread's CPU time (less disturbed
by other processes on shared cores than wall time), runs of the variants interleaved.
Ratios (old / new) are taken within this run. Prints ONE JSON line.

    python benchmarks/codec_roundtrip.py --repeats 9
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from swarmavg.compression import CodecInfo, get_codec
from swarmavg.compression.base import Codec

CHUNK = 1 << 18
CODECS = ["float16", "uint8-blockwise", "bfloat16", "scaled-float16"]


def _variants(codec: Codec, chunks: list[np.ndarray]) -> dict[str, Callable[[], None]]:
    info = CodecInfo(key="bench", finite=True)
    encoded = [codec.encode_payload(c, info) for c in chunks]

    def encode() -> None:
        for c in chunks:
            codec.encode_payload(c, info)

    def decode() -> None:
        for e in encoded:
            codec.decode_payload(e.header, e.payload)

    def old_values() -> None:
        for c in chunks:
            Codec.encode_payload_and_values(codec, c, info)  # the default: encode, decode

    def new_values() -> None:
        for c in chunks:
            codec.encode_payload_and_values(c, info)

    def new_round_trip() -> None:
        for c in chunks:
            codec.round_trip(c, info)

    return {
        "encode": encode,
        "decode": decode,
        "old_values": old_values,
        "new_values": new_values,
        "new_round_trip": new_round_trip,
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--elements", type=int, default=1 << 23)
    parser.add_argument("--repeats", type=int, default=9)
    parser.add_argument("--codecs", default=",".join(CODECS))
    args = parser.parse_args()
    x = np.random.default_rng(0).standard_normal(args.elements).astype(np.float32)
    chunks = [x[i : i + CHUNK] for i in range(0, x.size, CHUNK)]
    result: dict[str, object] = {
        "benchmark": "codec_roundtrip",
        "elements": args.elements,
        "chunk": CHUNK,
        "repeats": args.repeats,
        "unit": "thread CPU seconds for the whole vector, median",
    }
    for name in args.codecs.split(","):
        variants = _variants(get_codec(name), chunks)
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
        figures["values_speedup"] = round(med["old_values"] / med["new_values"], 2)
        figures["round_trip_speedup"] = round(med["old_values"] / med["new_round_trip"], 2)
        result[name] = figures
    print(json.dumps(result))


if __name__ == "__main__":
    main()
