# Signatures of the optional compiled kernels in _native.c (see native.py).
from collections.abc import Sequence

import numpy as np

any_alignment: int  # 1: buffers may sit at any address; 0: aligned to their items
weighted_sum_halves: int  # 1: weighted_sum takes binary16 copies (halves)

def f32_to_f16(src: np.ndarray, words: np.ndarray | None, values: np.ndarray | None) -> bool: ...
def f16_to_f32(words: np.ndarray, out: np.ndarray, check_first: bool = False) -> bool: ...
def quantize8(
    x: np.ndarray,
    block: int,
    lut: np.ndarray,
    table: np.ndarray,
    codes: np.ndarray | None,
    values: np.ndarray | None,
    scales: np.ndarray,
) -> bool: ...
def dequantize8(
    codes: np.ndarray, table: np.ndarray, scales: np.ndarray, block: int, out: np.ndarray
) -> None: ...
def scaled16(
    x: np.ndarray, means: np.ndarray, k: np.ndarray, row: int, words: np.ndarray
) -> None: ...
def copy_finite(src: np.ndarray, out: np.ndarray, itemsize: int) -> bool: ...
def check_copy(
    src: np.ndarray,
    out: np.ndarray | None,
    own: np.ndarray,
    backup: np.ndarray | None,
    itemsize: int,
    sums: np.ndarray,
) -> bool: ...
def all_finite(x: np.ndarray, itemsize: int) -> bool: ...
def weighted_sum(
    copies: Sequence[np.ndarray],
    weights: Sequence[float],
    d: float,
    itemsize: int,
    out: np.ndarray,
    halves: bytes = ...,
) -> bool: ...
def median_gram(
    stack: np.ndarray,
    n: int,
    pairs: np.ndarray,
    lower: int,
    upper: int,
    itemsize: int,
    median: np.ndarray,
    gram: np.ndarray,
) -> None: ...
def combine(
    stack: np.ndarray,
    n: int,
    median: np.ndarray,
    coeffs: np.ndarray,
    itemsize: int,
    out: np.ndarray,
) -> None: ...
def trimmed(
    stack: np.ndarray,
    n: int,
    pairs: np.ndarray,
    first: int,
    last: int,
    itemsize: int,
    out: np.ndarray,
) -> None: ...
def trimmed_weighted(
    stack: np.ndarray, n: int, k: int, weights: np.ndarray, itemsize: int, out: np.ndarray
) -> None: ...
