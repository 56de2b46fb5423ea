"""Input validation shared by the client and the daemon."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from swarmavg.averaging.request import RoundRequest
from swarmavg.peer.client.calls import PreparedAverage
from swarmavg.peer.client.errors import SwarmError, ValidationError
from swarmavg.peer.client.validation import (
    MAX_KEY_BYTES,
    same_layout,
    validate_arrays,
    validate_key,
)


def prepare(tensors: object, **overrides: object) -> PreparedAverage:
    kwargs: dict[str, object] = {
        "key": "k",
        "weight": 1.0,
        "group_size": None,
        "min_group_size": 2,
        "timeout": 5.0,
        "codec": None,
        "segments": None,
    }
    kwargs.update(overrides)
    return PreparedAverage(tensors, **kwargs)  # type: ignore[arg-type]


def test_validation_error_is_swarm_and_value_error() -> None:
    assert issubclass(ValidationError, SwarmError)
    assert issubclass(ValidationError, ValueError)


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([], "non-empty"),
        (np.zeros(3, np.float32), "list"),
        ([np.zeros(3, np.int64)], "unsupported dtype int64"),
        ([np.zeros(3, np.bool_)], "unsupported dtype bool"),
        ([np.zeros(2, np.complex64)], "unsupported dtype complex64"),
        ([np.array([1.0, np.nan], np.float32)], "1 NaN/Inf"),
        ([np.zeros(2, np.float16), np.array([np.inf], np.float64)], "tensor 1"),
        ([np.array([np.inf], ml_dtypes.bfloat16)], "NaN/Inf"),
        (["not a tensor"], "expected a numpy.ndarray"),
    ],
)
def test_bad_tensors(tensors: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        prepare(tensors)


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"key": ""}, "empty"),
        ({"key": "k" * (MAX_KEY_BYTES + 1)}, "limit"),
        ({"key": 5}, "str"),
        ({"weight": 0.0}, "weight"),
        ({"weight": float("nan")}, "weight"),
        ({"timeout": -1.0}, "timeout"),
        ({"group_size": 2, "min_group_size": 3}, "larger"),
        ({"codec": ""}, "codec"),
    ],
)
def test_bad_parameters(overrides: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        prepare([np.zeros(2, np.float32)], **overrides)


def test_good_inputs_pass() -> None:
    validate_key("é" * (MAX_KEY_BYTES // 2))
    RoundRequest.build(key="k", weight=0.5, group_size=4, min_group_size=2, timeout=1.0)
    arrays = [np.zeros((2, 3), np.float32), np.ones(4, ml_dtypes.bfloat16), np.zeros(0, np.float64)]
    assert validate_arrays(arrays) == 24 + 8 + 0


def test_same_layout_names_the_difference() -> None:
    a = [np.zeros(3, np.float32)]
    assert same_layout(a, [np.ones(3, np.float32)]) is None
    assert "tensor 0" in str(same_layout(a, [np.zeros(4, np.float32)]))
    assert same_layout(a, a + a) == "1 tensors vs 2"
