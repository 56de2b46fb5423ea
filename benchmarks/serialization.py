"""Tensor wire format throughput: 64 MB of float32 through serialise, chunk, reassemble.

Pipelines, each timed against ``np.copy`` of the same array right before it (median of
``--repeats`` ratios; one thread, CPU time of the thread, so other processes on a
shared machine do not distort the ratio):

- ``stream``: ``iter_chunks(codec.encode_payload(x))`` -> ``ChunkAssembler.add_payload``
  -> ``decode_payload``: what a sender and a receiver do, chunk by chunk, minus gRPC;
- ``stream_wire``: the same plus ``SerializeToString``/``FromString`` of every chunk
  (the protobuf work gRPC adds on each side);
- ``list``: the public one-liners ``deserialize_array(serialize_array(x))``, which
  hold every chunk of the tensor in memory at once.

    python benchmarks/serialization.py
    python benchmarks/serialization.py --mb 64 --chunk-kib 256,1024 --repeats 7

Prints ONE JSON line. The issue's goal: >= 0.3 of memcpy, so that the wire format is
never the bottleneck of a 1 GB/s link.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import numpy as np

from swarmavg.compression import CodecInfo, get_codec
from swarmavg.compression.serialization import (
    ChunkAssembler,
    deserialize_array,
    iter_chunks,
    serialize_array,
)
from swarmavg.proto import tensor_pb2


def stream(x: np.ndarray, chunk: int, wire: bool) -> np.ndarray:
    codec = get_codec("none")
    assembler = ChunkAssembler(max_total_bytes=x.nbytes)
    done = None
    for message in iter_chunks(codec.encode_payload(x, CodecInfo()), chunk):
        if wire:
            message = tensor_pb2.TensorChunk.FromString(message.SerializeToString())
        done = assembler.add_payload(message)
    if done is None:
        raise RuntimeError("stream did not complete")
    header, payload = done
    return codec.decode_payload(header, payload)


def as_list(x: np.ndarray, chunk: int) -> np.ndarray:
    return deserialize_array(serialize_array(x, max_chunk_bytes=chunk), max_total_bytes=x.nbytes)


def ratio(fn: Callable[[], np.ndarray], x: np.ndarray, repeats: int) -> dict[str, float]:
    ratios, times = [], []
    for _ in range(repeats):
        t0 = time.thread_time()
        np.copy(x)
        t1 = time.thread_time()
        y = fn()
        t2 = time.thread_time()
        ratios.append((t1 - t0) / (t2 - t1))
        times.append(t2 - t1)
        if not np.array_equal(x, y):
            raise RuntimeError("round trip changed the data")
    return {
        "vs_memcpy": statistics.median(ratios),
        "MBps": x.nbytes / 1e6 / statistics.median(times),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--chunk-kib", default="256,1024")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    x = np.random.default_rng(0).standard_normal(args.mb * 2**20 // 4, dtype=np.float32)
    copies = []
    for _ in range(args.repeats):
        t0 = time.thread_time()
        np.copy(x)
        copies.append(time.thread_time() - t0)
    results: dict[str, dict[str, float]] = {}
    for kib in (int(k) for k in args.chunk_kib.split(",")):
        chunk = kib * 1024
        results[f"stream_{kib}KiB"] = ratio(lambda c=chunk: stream(x, c, False), x, args.repeats)
        results[f"stream_wire_{kib}KiB"] = ratio(
            lambda c=chunk: stream(x, c, True), x, args.repeats
        )
        results[f"list_{kib}KiB"] = ratio(lambda c=chunk: as_list(x, c), x, args.repeats)
    print(
        json.dumps(
            {
                "benchmark": "serialization",
                "bytes": x.nbytes,
                "memcpy_MBps": x.nbytes / 1e6 / statistics.median(copies),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
