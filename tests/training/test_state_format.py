"""Training state <-> (metadata, arrays), the way it crosses publish_state/load_state."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.training.state import (  # noqa: E402
    StateFormatError,
    TrainingState,
    pack_state,
    unpack_state,
)


def through_the_wire(metadata: object, arrays: list[np.ndarray]) -> tuple[object, list[np.ndarray]]:
    # the client msgpacks the metadata and the daemon decodes with strict_map_key=True
    packed = msgpack.packb(metadata, use_bin_type=True)
    return msgpack.unpackb(packed, raw=False), [a.copy() for a in arrays]


def adam_state() -> tuple[list[torch.nn.Parameter], torch.optim.Adam]:
    torch.manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(3, 2)), torch.nn.Parameter(torch.randn(2))]
    opt = torch.optim.Adam(params, lr=1e-2, betas=(0.8, 0.95))
    for _ in range(2):
        opt.zero_grad()
        sum((p**2).sum() for p in params).backward()  # type: ignore[union-attr]
        opt.step()
    return params, opt


def test_adam_state_round_trips_through_msgpack() -> None:
    params, opt = adam_state()
    state = TrainingState("collaborative", 7, list(params), {"optimizer": opt.state_dict()})
    metadata, arrays = through_the_wire(*pack_state(state))
    loaded = unpack_state(metadata, arrays, kind="collaborative", like=params)
    assert loaded.epoch == 7
    for a, b in zip(loaded.params, params, strict=True):
        assert torch.equal(a, b.detach())
    fresh = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
    opt2 = torch.optim.Adam(fresh, lr=1.0)
    opt2.load_state_dict(loaded.optimizers["optimizer"])
    original, restored = opt.state_dict(), opt2.state_dict()
    assert restored["param_groups"][0]["betas"] == (0.8, 0.95)
    assert restored["param_groups"][0]["lr"] == 1e-2
    for index, values in original["state"].items():
        for name, value in values.items():
            assert torch.equal(restored["state"][index][name], value), name
    # and the restored optimizer keeps working (its 0-d "step" tensors came back as tensors)
    fresh[0].grad = torch.ones_like(fresh[0])
    opt2.step()


def test_bfloat16_parameters_keep_their_dtype() -> None:
    p = torch.randn(4).to(torch.bfloat16)
    metadata, arrays = through_the_wire(*pack_state(TrainingState("diloco", 1, [p])))
    loaded = unpack_state(metadata, arrays, kind="diloco", like=[p])
    assert loaded.params[0].dtype == torch.bfloat16
    assert torch.equal(loaded.params[0], p)


@pytest.mark.parametrize(
    ("mutate", "message"),
    [
        (lambda m, a: ({**m, "format": "other"}, a), "format"),
        (lambda m, a: ({**m, "kind": "diloco"}, a), "published by"),
        (lambda m, a: ({**m, "epoch": -1}, a), "epoch"),
        (lambda m, a: (m, a[:1]), "refers to array"),
        (lambda m, a: (m, [np.zeros(5, np.float32), *a[1:]]), "elements"),
        (lambda m, a: (b"\xc1", a), "msgpack"),
        (lambda m, a: ({**m, "params": m["params"][:1]}, a), "parameters"),
    ],
)
def test_malformed_states_are_refused(mutate: object, message: str) -> None:
    params = [torch.randn(3, 2), torch.randn(2)]
    metadata, arrays = through_the_wire(*pack_state(TrainingState("collaborative", 2, params)))
    bad_metadata, bad_arrays = mutate(metadata, arrays)  # type: ignore[operator]
    with pytest.raises(StateFormatError, match=message):
        unpack_state(bad_metadata, bad_arrays, kind="collaborative", like=params)


def test_a_state_of_another_model_is_refused() -> None:
    metadata, arrays = pack_state(TrainingState("collaborative", 0, [torch.zeros(3)]))
    with pytest.raises(StateFormatError, match="shape"):
        unpack_state(metadata, arrays, kind="collaborative", like=[torch.zeros(4)])
