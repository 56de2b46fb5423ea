"""The daemon's and the client's checked copy of a call's inputs (peer/client/handoff.py): the
compiled one-pass kernel and the numpy blocks copy the same bits and refuse the same
NaN/Inf, wherever it sits."""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.averaging.errors import InvalidTensorsError
from swarmavg.compression import native
from swarmavg.peer.client.handoff import copy_checked

pytestmark = pytest.mark.timeout(60)

KERNELS = [
    pytest.param(
        True,
        id="compiled",
        marks=pytest.mark.skipif(native.kernels is None, reason="compiled kernels not built"),
    ),
    pytest.param(False, id="numpy"),
]


@pytest.fixture(params=KERNELS)
def compiled(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> bool:
    if not request.param:
        monkeypatch.setattr(native, "kernels", None)  # the checked copy and the scan
    return bool(request.param)


def awkward(dtype: type, n: int) -> np.ndarray:
    """Values whose bits a lossy copy would change: signed zeros, subnormals, extremes."""
    info = np.finfo(dtype)
    special = np.array([-0.0, 0.0, info.tiny / 4, -info.tiny / 3, info.max, -info.max], dtype)
    rng = np.random.default_rng(n)
    values = rng.standard_normal(n).astype(dtype)
    values[: len(special)] = special[:n]
    return values


@pytest.mark.parametrize("dtype", [np.float32, np.float64, np.float16])
@pytest.mark.parametrize("n", [1, 7, 65_536 + 3, 600_000])
def test_the_copy_has_the_same_bits(compiled: bool, dtype: type, n: int) -> None:
    sources = [awkward(dtype, n), np.arange(n, dtype=np.int64)]
    out = [np.empty_like(s) for s in sources]
    copy_checked(sources, out, block_bytes=4096)
    for src, dst in zip(sources, out, strict=True):
        np.testing.assert_array_equal(src.view(np.uint8), dst.view(np.uint8))


@pytest.mark.parametrize("dtype", [np.float32, np.float64])
@pytest.mark.parametrize("bad", [np.nan, np.inf, -np.inf])
@pytest.mark.parametrize("where", [0, 4_095, 99_999])
def test_nan_and_inf_are_refused_wherever_they_sit(
    compiled: bool, dtype: type, bad: float, where: int
) -> None:
    clean = awkward(dtype, 100_000)
    poisoned = clean.copy()
    poisoned[where] = bad
    out = [np.empty_like(clean), np.empty_like(clean)]
    with pytest.raises(InvalidTensorsError, match=r"tensor 1 holds 1 NaN/Inf"):
        copy_checked([clean, poisoned], out, block_bytes=4096)


def test_a_non_contiguous_source_is_copied_by_the_numpy_blocks(compiled: bool) -> None:
    base = awkward(np.float32, 2_000).reshape(40, 50)
    view = base[:, ::2]  # strided: the kernel does not apply
    out = [np.empty(view.shape, np.float32)]
    copy_checked([view], out, block_bytes=256)
    np.testing.assert_array_equal(out[0], view)
    view[3, 4] = np.nan
    with pytest.raises(InvalidTensorsError, match="tensor 0 holds 1"):
        copy_checked([view], out)
