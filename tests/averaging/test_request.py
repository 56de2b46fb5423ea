"""RoundRequest: one round's parameters, checked once where a call enters."""

from __future__ import annotations

import ml_dtypes
import numpy as np
import pytest

from swarmavg.averaging.errors import InvalidRequestError, InvalidTensorsError
from swarmavg.averaging.request import (
    MAX_KEY_BYTES,
    MAX_STATE_DIGEST_BYTES,
    STATE_DIGEST_TAG,
    RoundRequest,
    check_finite,
    check_tensors,
    digests_from_user_data,
)


def test_deadline_is_fixed_once_from_the_start_instant() -> None:
    request = RoundRequest.build(key="k", timeout=12.5, now=100.0)
    assert request.deadline == 112.5


def test_defaults_and_types() -> None:
    request = RoundRequest.build(key="k", weight=np.float32(2), group_size=np.int64(4))
    assert (request.weight, request.group_size, request.min_group_size) == (2.0, 4, 2)
    assert type(request.group_size) is int
    assert request.codec is None


def test_codec_parameters_are_kept() -> None:
    # The leader builds its codec from this spec: dropping the parameters would silently
    # run topk at its default fraction.
    assert RoundRequest.build(key="k", codec="topk:fraction=0.05").codec == "topk:fraction=0.05"


@pytest.mark.parametrize(
    ("overrides", "message"),
    [
        ({"key": ""}, "key"),
        ({"key": 7}, "key"),
        ({"key": "k" * (MAX_KEY_BYTES + 1)}, "limit"),
        ({"weight": 0.0}, "weight"),
        ({"weight": -1.0}, "weight"),
        ({"weight": float("inf")}, "weight"),
        ({"weight": True}, "weight"),
        ({"timeout": 0}, "timeout"),
        ({"timeout": float("nan")}, "timeout"),
        ({"timeout": "5"}, "timeout"),
        ({"group_size": 0}, "group_size"),
        ({"group_size": 2.0}, "group_size"),
        ({"group_size": 257}, "group_size"),
        ({"min_group_size": 0}, "min_group_size"),
        ({"group_size": 2, "min_group_size": 3}, "larger"),
        ({"max_group_size": 4}, "needs a group_size"),
        ({"group_size": 4, "max_group_size": 3}, "smaller than group_size"),
        ({"group_size": 4, "max_group_size": 257}, "max_group_size"),
        ({"group_size": 4, "max_group_size": 5.0}, "max_group_size"),
        ({"codec": ""}, "codec"),
        ({"codec": "fp16"}, "known"),
        ({"state_digest": "abc"}, "state_digest"),
        ({"state_digest": b"x" * (MAX_STATE_DIGEST_BYTES + 1)}, "limit"),
    ],
)
def test_bad_parameters(overrides: dict[str, object], message: str) -> None:
    arguments: dict[str, object] = {"key": "k", **overrides}
    with pytest.raises(InvalidRequestError, match=message):
        RoundRequest.build(**arguments)  # type: ignore[arg-type]


def test_state_digest_is_tagged_user_data_and_read_back_from_the_group() -> None:
    plain = RoundRequest.build(key="k")
    assert plain.state_digest == b""
    assert plain.user_data(b"daemon's own") == b"daemon's own"
    request = RoundRequest.build(key="k", state_digest=bytearray(b"d" * MAX_STATE_DIGEST_BYTES))
    assert request.state_digest == b"d" * MAX_STATE_DIGEST_BYTES
    gathered = {
        "aa": request.user_data(b"ignored"),
        "bb": b"daemon's own user data",  # not a digest: left out
        "cc": STATE_DIGEST_TAG,  # an empty digest: left out
        "dd": STATE_DIGEST_TAG + b"x" * (MAX_STATE_DIGEST_BYTES + 1),  # forged: left out
    }
    assert digests_from_user_data(gathered) == {"aa": b"d" * MAX_STATE_DIGEST_BYTES}


def test_zero_weight_only_when_allowed() -> None:
    assert RoundRequest.build(key="k", weight=0.0, allow_zero_weight=True).weight == 0.0


def test_invalid_request_is_a_value_error() -> None:
    assert issubclass(InvalidRequestError, ValueError)
    assert issubclass(InvalidTensorsError, InvalidRequestError)


def test_check_tensors_gives_read_only_views() -> None:
    source = np.zeros(3, np.float32)
    (view,) = check_tensors([source])
    assert not view.flags.writeable
    assert source.flags.writeable


@pytest.mark.parametrize(
    ("tensors", "message"),
    [
        ([], "empty"),
        (np.zeros(2, np.float32), "list"),
        ([[1.0]], "not a numpy array"),
        ([np.zeros(2, np.complex64)], "unsupported dtype"),
    ],
)
def test_check_tensors_rejects(tensors: object, message: str) -> None:
    with pytest.raises(InvalidTensorsError, match=message):
        check_tensors(tensors)


def test_check_finite_names_the_tensor() -> None:
    check_finite([np.array([1, 2], np.int64), np.zeros(2, np.float16)])
    with pytest.raises(InvalidTensorsError, match="tensor 1 holds 2 NaN/Inf"):
        check_finite([np.zeros(2), np.array([np.nan, np.inf, 0], ml_dtypes.bfloat16)])


@pytest.mark.parametrize(
    "arguments",
    [
        {"key": "k"},
        {
            "key": "step-7",
            "weight": 2.5,
            "group_size": 8,
            "min_group_size": 3,
            "max_group_size": 10,
            "codec": "topk:fraction=0.05",
            "state_digest": b"d" * 32,
            "aggregation": "trimmed-mean",
        },
    ],
)
def test_request_crosses_the_control_protocol_unchanged(arguments: dict[str, object]) -> None:
    # The daemon rebuilds the client's request from AverageStart: every field must arrive,
    # the ones left to the daemon's default (None) included, and the deadline is fixed on
    # the daemon's clock from the caller's timeout.
    from swarmavg.proto import control_pb2

    request = RoundRequest.build(timeout=12.5, now=100.0, **arguments)  # type: ignore[arg-type]
    start = control_pb2.AverageStart(**request.wire_fields(12.5))
    assert RoundRequest.from_wire(start, now=100.0) == request


def test_request_from_the_wire_is_checked() -> None:
    from swarmavg.proto import control_pb2

    with pytest.raises(InvalidRequestError, match="weight"):
        RoundRequest.from_wire(control_pb2.AverageStart(key="k", weight=-1.0, timeout=5), 0.0)
    with pytest.raises(InvalidRequestError, match="timeout"):
        RoundRequest.from_wire(control_pb2.AverageStart(key="k", weight=1.0), 0.0)
