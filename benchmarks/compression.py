"""Codec accuracy, wire size and speed on three 16M-element float32 tensors.

Tensors (all float32, 16 * 2**20 elements = 64 MiB):

- ``normal``: N(0, 1), seed 0;
- ``student_t3``: Student t with 3 degrees of freedom (heavy tails), seed 1;
- ``gradients``: real gradients. A 64-512-512-10 ReLU MLP (301,066 parameters) is
  trained with SGD (lr 0.05, batch 32) on scikit-learn's bundled ``digits`` data set
  (1,797 8x8 images, standardised); the flattened gradients of consecutive steps are
  concatenated (56 steps), then truncated to 16M elements. Needs torch (training side).

Per codec and tensor: relative MSE (sum of squared errors / sum of squares), max abs
error, wire bytes per parameter (payload + meta), and encode/decode throughput in MB/s
of float32 input, on one thread (whole tensor) and on all cores (1M-element chunks, one
task per chunk, in a thread pool: numpy releases the GIL). Every throughput is also
given as a ratio to ``np.copy`` of the same 64 MiB array on one thread, timed right
before each run (median of ``--repeats`` ratios), because the machines are shared and
noisy. Single-thread times are the thread's CPU time (``time.thread_time``), so other
processes on a shared machine do not inflate them; all-core times are wall-clock.

Codec cost is measured on ``encode_payload``/``decode_payload``: the codec's own work,
without the protobuf copy that ``encode`` adds.

    python -m benchmarks.compression                    # everything (~2-4 min)
    python -m benchmarks.compression --codecs float16,uint8-blockwise --repeats 3
    python -m benchmarks.compression --codecs none --reference    # hivemind's accuracy
    python -m benchmarks.compression --public --repeats 7          # public API vs internal

``--public`` times instead, per codec on each tensor, the public
``Codec.encode``/``Codec.decode`` (protobuf ``TensorChunk`` in and out) against the
internal path the all-reduce uses (``encode_payload``/``decode_payload``: no protobuf), one
thread, each run right after an ``np.copy`` of the same array, the five interleaved in
every repeat; it prints ONE JSON line PER CODEC: medians of the ratios to memcpy, and
whether the public message carries exactly the internal payload.

``--reference`` adds the relative MSE of hivemind 1.1.12's three 8-bit algorithms,
re-implemented in numpy from its source (for accuracy only, no timing).

Prints ONE JSON line.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

from swarmavg.compression import CodecInfo, get_codec
from swarmavg.compression.base import Codec, Encoded

N = 16 * 2**20
CHUNK = 2**20
CODECS = [
    "float16",
    "bfloat16",
    "scaled-float16",
    "uint8-uniform",
    "uint8-quantile",
    "uint8-blockwise",
    "uint4-blockwise",
    "topk",
    "zstd+uint8-blockwise",
    "lz4+uint8-blockwise",
    "zstd+topk",
]


def real_gradients(n: int) -> np.ndarray:
    """Gradients of a small MLP training on scikit-learn's digits (see module doc)."""
    import torch
    from sklearn.datasets import load_digits

    torch.manual_seed(0)
    data = load_digits()
    x = torch.tensor(data.data, dtype=torch.float32)
    x = (x - x.mean(0)) / (x.std(0) + 1e-6)
    y = torch.tensor(data.target)
    model = torch.nn.Sequential(
        torch.nn.Linear(64, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 512),
        torch.nn.ReLU(),
        torch.nn.Linear(512, 10),
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.05)
    gen = torch.Generator().manual_seed(0)
    grads: list[np.ndarray] = []
    total = 0
    while total < n:
        idx = torch.randint(0, len(x), (32,), generator=gen)
        opt.zero_grad()
        loss = torch.nn.functional.cross_entropy(model(x[idx]), y[idx])
        loss.backward()
        flat = torch.cat([p.grad.reshape(-1) for p in model.parameters()])  # type: ignore[union-attr]
        grads.append(flat.numpy().copy())
        total += flat.numel()
        opt.step()
    return np.concatenate(grads)[:n].astype(np.float32)


def tensors(n: int) -> dict[str, np.ndarray]:
    return {
        "normal": np.random.default_rng(0).standard_normal(n, dtype=np.float32),
        "student_t3": np.random.default_rng(1).standard_t(3, n).astype(np.float32),
        "gradients": real_gradients(n),
    }


# --- hivemind 1.1.12's 8-bit algorithms, re-implemented in numpy for accuracy only ---
# (hivemind/compression/quantization.py; installing hivemind here is optional and its
# 8-bit decoders fail under numpy 2, see the issue.) Used for relative MSE, not speed.


def _average_buckets(x: np.ndarray, codes: np.ndarray, n_bins: int = 256) -> np.ndarray:
    sums = np.bincount(codes, weights=x, minlength=n_bins)
    counts = np.maximum(np.bincount(codes, minlength=n_bins), 1)
    return (sums / counts).astype(np.float32)


def hivemind_uniform(x: np.ndarray) -> np.ndarray:
    # Uniform8BitQuantization: scale = 6 * std / 256 around the mean, offset 128.
    shift = x.mean(dtype=np.float64)
    centred = x - shift
    std = np.linalg.norm(centred.astype(np.float64)) / np.sqrt(x.size - 1)
    scale = 6 * std / 256
    codes = np.clip(np.round(centred / scale) + 128, 0, 255).astype(np.int64)
    return _average_buckets(x, codes)[codes]


def hivemind_quantile(x: np.ndarray) -> np.ndarray:
    # Quantile8BitQuantization: quantile-of-quantiles over chunks of 1e5, torch.bucketize.
    levels = np.linspace(0.0, 1.0, num=257, dtype=x.dtype)
    chunk = 10**5
    per_chunk = np.stack([np.quantile(x[i : i + chunk], levels) for i in range(0, x.size, chunk)])
    borders = np.quantile(per_chunk, levels)[1:-1]
    codes = np.clip(np.searchsorted(borders, x, side="left"), 0, 255)
    return _average_buckets(x, codes)[codes]


def _bnb_dynamic_map() -> np.ndarray:
    # bitsandbytes.functional.create_dynamic_map(signed=True, max_exponent_bits=7, total_bits=8)
    data: list[float] = []
    for i in range(7):
        items = 2**i + 1
        bounds = np.linspace(0.1, 1, items)
        means = (bounds[:-1] + bounds[1:]) / 2.0
        data += (10 ** (-6 + i) * means).tolist()
        data += (-(10 ** (-6 + i)) * means).tolist()
    data += [0.0, 1.0]
    return np.array(sorted(data))


def hivemind_blockwise(x: np.ndarray, block: int = 4096) -> np.ndarray:
    # BlockwiseQuantization = bitsandbytes quantize_blockwise (nearest code of the
    # dynamic map after absmax scaling per block of 4096).
    code = _bnb_dynamic_map()
    pad = (-x.size) % block
    blocks = np.concatenate([x, np.zeros(pad, x.dtype)]).reshape(-1, block).astype(np.float64)
    absmax = np.maximum(np.abs(blocks).max(axis=1, keepdims=True), 1e-30)
    v = blocks / absmax
    mid = (code[1:] + code[:-1]) / 2
    out = code[np.searchsorted(mid, v)] * absmax
    return out.reshape(-1)[: x.size].astype(np.float32)


def reference_accuracy(data: dict[str, np.ndarray]) -> dict[str, dict[str, float]]:
    out: dict[str, dict[str, float]] = {}
    for label, x in data.items():
        x64 = x.astype(np.float64)
        norm = float((x64**2).sum())
        out[label] = {
            name: float(((fn(x).astype(np.float64) - x64) ** 2).sum() / norm)
            for name, fn in [
                ("uint8-uniform", hivemind_uniform),
                ("uint8-quantile", hivemind_quantile),
                ("uint8-blockwise", hivemind_blockwise),
            ]
        }
        print(f"hivemind reference {label:11s} {out[label]}", file=sys.stderr)
    return out


def ratio_to_copy(
    fn: Callable[[], object], x: np.ndarray, repeats: int, clock: Callable[[], float]
) -> tuple[float, float]:
    """Median seconds of ``fn`` and median of (copy time / fn time), the copy of ``x``
    timed right before each run so that both see the same machine load."""
    times, ratios = [], []
    for _ in range(repeats):
        t0 = clock()
        np.copy(x)
        t1 = clock()
        fn()
        t2 = clock()
        times.append(t2 - t1)
        ratios.append((t1 - t0) / (t2 - t1))
    return statistics.median(times), statistics.median(ratios)


def measure(name: str, x: np.ndarray, repeats: int, pool: ThreadPoolExecutor) -> dict[str, Any]:
    codec: Codec = get_codec(name)
    info = CodecInfo(key="bench")
    enc = codec.encode_payload(x, info)
    y = codec.decode_payload(enc.header, enc.payload)
    x64 = x.astype(np.float64)
    err = y.astype(np.float64) - x64
    wire = memoryview(enc.payload).nbytes + len(enc.header.meta_bytes())
    mb = x.nbytes / 1e6

    def fresh() -> Codec:
        return get_codec(name)  # top-k: no residual carried between timed runs

    # One thread: CPU time of this thread, so that other processes on the shared
    # machine do not count against the codec (or the copy).
    cpu = time.thread_time
    enc_1, enc_1r = ratio_to_copy(lambda: fresh().encode_payload(x, info), x, repeats, cpu)
    dec_1, dec_1r = ratio_to_copy(
        lambda: codec.decode_payload(enc.header, enc.payload), x, repeats, cpu
    )

    pieces = [x[i : i + CHUNK] for i in range(0, x.size, CHUNK)]

    def encode_all() -> list[Encoded]:
        c = fresh()
        return list(pool.map(lambda p: c.encode_payload(p, info), pieces))

    encoded = encode_all()

    def decode_all() -> None:
        list(pool.map(lambda e: codec.decode_payload(e.header, e.payload), encoded))

    # All cores: wall-clock time.
    wall = time.perf_counter
    enc_n, enc_nr = ratio_to_copy(encode_all, x, repeats, wall)
    dec_n, dec_nr = ratio_to_copy(decode_all, x, repeats, wall)
    return {
        "rel_mse": float((err**2).sum() / (x64**2).sum()),
        "max_abs_err": float(np.abs(err).max()),
        "bytes_per_param": wire / x.size,
        "encode_MBps_1t": mb / enc_1,
        "decode_MBps_1t": mb / dec_1,
        "encode_MBps_all": mb / enc_n,
        "decode_MBps_all": mb / dec_n,
        "encode_vs_memcpy_1t": enc_1r,
        "decode_vs_memcpy_1t": dec_1r,
        "encode_vs_memcpy_all": enc_nr,
        "decode_vs_memcpy_all": dec_nr,
    }


def measure_public(name: str, x: np.ndarray, repeats: int) -> dict[str, Any]:
    """Ratios to memcpy of the public API and the internal path (see module doc)."""
    info = CodecInfo(key="bench")
    codec: Codec = get_codec(name)
    internal = codec.encode_payload(x, info)
    message = get_codec(name).encode(x, info)
    clock = time.thread_time
    variants: dict[str, Callable[[], object]] = {
        # A fresh codec per run: top-k carries no residual between timed runs.
        "encode_internal": lambda: get_codec(name).encode_payload(x, info),
        "encode_public": lambda: get_codec(name).encode(x, info),
        "decode_internal": lambda: codec.decode_payload(internal.header, internal.payload),
        "decode_public": lambda: codec.decode(message),
    }
    ratios: dict[str, list[float]] = {k: [] for k in variants}
    for _ in range(repeats):
        for key, fn in variants.items():
            t0 = clock()
            np.copy(x)
            t1 = clock()
            fn()
            t2 = clock()
            ratios[key].append((t1 - t0) / max(t2 - t1, 1e-9))
    out: dict[str, Any] = {k: statistics.median(v) for k, v in ratios.items()}
    out["identical_bytes"] = message.buffer == bytes(internal.payload) and (
        message.meta == internal.header.meta_bytes()
    )
    return out


def main_public(names: list[str], data: dict[str, np.ndarray], repeats: int) -> None:
    for name in names:
        per_tensor = {label: measure_public(name, x, repeats) for label, x in data.items()}
        keys = ["encode_internal", "encode_public", "decode_internal", "decode_public"]
        print(
            json.dumps(
                {
                    "benchmark": "compression_public",
                    "codec": name,
                    "elements": next(iter(data.values())).size,
                    "repeats": repeats,
                    "unit": "ratio to np.copy of the same array, thread CPU time, median",
                    "tensors": per_tensor,
                    "median_of_tensors": {
                        k: statistics.median(t[k] for t in per_tensor.values()) for k in keys
                    },
                    "hivemind_1_1_12_scaled_float16_encode": 0.12,
                }
            ),
            flush=True,
        )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--codecs", default=",".join(CODECS))
    parser.add_argument("--tensors", default="normal,student_t3,gradients")
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--elements", type=int, default=N)
    parser.add_argument(
        "--reference",
        action="store_true",
        help="also compute the relative MSE of hivemind's 8-bit algorithms (numpy port)",
    )
    parser.add_argument(
        "--public",
        action="store_true",
        help="public encode/decode against the internal path, one JSON line per codec",
    )
    args = parser.parse_args()
    names = [c for c in args.codecs.split(",") if c]
    data = {k: v for k, v in tensors(args.elements).items() if k in args.tensors.split(",")}
    if args.public:
        main_public(names, data, args.repeats)
        return
    threads = os.cpu_count() or 1
    results: dict[str, dict[str, Any]] = {}
    with ThreadPoolExecutor(threads) as pool:
        for name in names:
            results[name] = {}
            for label, x in data.items():
                results[name][label] = measure(name, x, args.repeats, pool)
                print(f"{name:22s} {label:11s} {results[name][label]}", file=sys.stderr)
    reference = reference_accuracy(data) if args.reference else None
    x = next(iter(data.values()))
    copies = []
    for _ in range(args.repeats):
        t0 = time.thread_time()
        np.copy(x)
        copies.append(time.thread_time() - t0)
    copy_s = statistics.median(copies)
    print(
        json.dumps(
            {
                "benchmark": "compression",
                "elements": x.size,
                "threads": threads,
                "memcpy_MBps_1t": x.nbytes / 1e6 / max(copy_s, 1e-9),
                "results": results,
                "hivemind_reference_rel_mse": reference,
            }
        )
    )


if __name__ == "__main__":
    main()
