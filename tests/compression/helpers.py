"""Shared data and helpers for the codec tests."""

from __future__ import annotations

import ml_dtypes
import numpy as np

FLOAT_DTYPES = [np.float32, np.float16, ml_dtypes.bfloat16, np.float64]
LOSSY = [
    "float16",
    "bfloat16",
    "scaled-float16",
    "uint8-uniform",
    "uint8-quantile",
    "uint8-blockwise",
    "uint4-blockwise",
    "topk",
]
ALL_CODECS = ["none", *LOSSY, "size-adaptive", "role-adaptive", "zstd+uint8-blockwise", "lz4+topk"]


def dtype_id(d: object) -> str:
    return np.dtype(d).name  # type: ignore[call-overload, no-any-return]


def normal(n: int, dtype: object = np.float32, seed: int = 0) -> np.ndarray:
    return np.random.default_rng(seed).standard_normal(n).astype(dtype)  # type: ignore[call-overload, no-any-return]


def rel_mse(x: np.ndarray, y: np.ndarray) -> float:
    a = x.astype(np.float64)
    b = y.astype(np.float64)
    return float(np.mean((a - b) ** 2) / max(np.mean(a**2), 1e-300))
