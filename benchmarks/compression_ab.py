"""A/B timing of encoders: a git revision's codec modules against the working tree's.

A measurement helper for docs/benchmarks-compression.md.
Loads ``compression/floating.py`` and ``compression/quantization.py`` as they were at
``--before`` (via ``git show``) next to the current ones, and on benchmarks/compression.py's
three tensors interleaves before/after encodes in one process, each timed (thread CPU time)
right after an ``np.copy`` of the same array. Prints ONE JSON line: per codec and tensor,
the median ratio to memcpy, relative MSE and max abs error, before and after.

    python benchmarks/compression_ab.py --before e5d223b --repeats 9
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from types import ModuleType
from typing import Any

import numpy as np

from swarmavg.compression import CodecInfo, get_codec
from swarmavg.compression.base import Codec

ROOT = Path(__file__).resolve().parents[1]


def _old_module(revision: str, path: str, directory: Path) -> ModuleType:
    source = subprocess.run(
        ["git", "-C", str(ROOT), "show", f"{revision}:{path}"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    name = "before_" + Path(path).stem
    file = directory / f"{name}.py"
    file.write_text(source)
    spec = importlib.util.spec_from_file_location(name, file)
    assert spec is not None
    assert spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--before", default="e5d223b")
    parser.add_argument("--repeats", type=int, default=9)
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT / "benchmarks"))
    import compression as bench  # benchmarks/compression.py: the same three tensors

    with tempfile.TemporaryDirectory() as tmp:
        floating = _old_module(args.before, "compression/floating.py", Path(tmp))
        quantization = _old_module(args.before, "compression/quantization.py", Path(tmp))
    pairs: dict[str, tuple[Codec, Codec]] = {
        "scaled-float16": (floating.ScaledFloat16Codec(), get_codec("scaled-float16")),
        "uint8-quantile": (quantization.Quantile8BitCodec(), get_codec("uint8-quantile")),
    }
    info = CodecInfo(key="bench")
    out: dict[str, Any] = {"benchmark": "ab_encoders", "before": args.before, "results": {}}
    for tensor, x in bench.tensors(bench.N).items():
        x64 = x.astype(np.float64)
        squares = float((x64**2).sum())
        for name, codecs in pairs.items():
            row: dict[str, float] = {}
            ratios: dict[str, list[float]] = {"before": [], "after": []}
            for label, codec in zip(ratios, codecs, strict=True):
                enc = codec.encode_payload(x, info)
                y = codec.decode_payload(enc.header, enc.payload).astype(np.float64)
                row[f"rel_mse_{label}"] = float(((y - x64) ** 2).sum() / squares)
                row[f"max_abs_err_{label}"] = float(np.abs(y - x64).max())
            for _ in range(args.repeats):
                for label, codec in zip(ratios, codecs, strict=True):
                    t0 = time.thread_time()
                    np.copy(x)
                    t1 = time.thread_time()
                    codec.encode_payload(x, info)
                    t2 = time.thread_time()
                    ratios[label].append((t1 - t0) / (t2 - t1))
            for label, values in ratios.items():
                row[f"encode_vs_memcpy_{label}"] = statistics.median(values)
            out["results"][f"{name}/{tensor}"] = row
    print(json.dumps(out))


if __name__ == "__main__":
    main()
