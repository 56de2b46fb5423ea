# Signatures of the optional compiled kernels in _native.c (see native.py).
import numpy as np

any_alignment: int  # 1: buffers may sit at any address; 0: aligned to their items

def f32_to_f16(src: np.ndarray, words: np.ndarray | None, values: np.ndarray | None) -> bool: ...
def f16_to_f32(words: np.ndarray, out: np.ndarray) -> bool: ...
def quantize8(
    x: np.ndarray,
    inverse: np.ndarray,
    scales: np.ndarray,
    block: int,
    lut: np.ndarray,
    table: np.ndarray,
    codes: np.ndarray | None,
    values: np.ndarray | None,
) -> None: ...
def dequantize8(
    codes: np.ndarray, table: np.ndarray, scales: np.ndarray, block: int, out: np.ndarray
) -> None: ...
def block_scales(x: np.ndarray, block: int, out: np.ndarray) -> bool: ...
def scaled16(
    x: np.ndarray, means: np.ndarray, k: np.ndarray, row: int, words: np.ndarray
) -> None: ...
def copy_finite(src: np.ndarray, out: np.ndarray, itemsize: int) -> bool: ...
def all_finite(x: np.ndarray, itemsize: int) -> bool: ...
def weighted_sum(
    a: np.ndarray,
    wa: float,
    b: np.ndarray | None,
    wb: float,
    d: float,
    itemsize: int,
    out: np.ndarray,
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
