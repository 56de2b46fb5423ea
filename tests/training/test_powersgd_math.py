"""PowerSGD's factors against numpy's SVD, its error feedback and warm start (no daemon)."""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.averaging.training.powersgd import PowerSGDState, compressible, orthogonalize


def _low_rank_plus_noise(rng: np.random.Generator, n: int = 20, m: int = 12) -> np.ndarray:
    u, _ = np.linalg.qr(rng.standard_normal((n, n)))
    v, _ = np.linalg.qr(rng.standard_normal((m, m)))
    s = np.array([10.0, 6.0, 3.0] + [0.3] * (m - 3))
    return ((u[:, :m] * s) @ v.T).astype(np.float32)


def _one_member_round(state: PowerSGDState, grads: list[np.ndarray]) -> list[np.ndarray]:
    """Both rounds for a swarm of one (each average is the member's own tensors)."""
    matrices = state.matrices(grads)
    first = state.first_round(grads, matrices)
    ps, qs = state.second_round(matrices, first)
    return state.finish(grads, matrices, ps, first, [qs[i] for i in state.compressed])


def test_orthogonalize_gives_orthonormal_columns_of_the_same_span() -> None:
    p = np.random.default_rng(0).standard_normal((9, 3)).astype(np.float32)
    q = orthogonalize(p)
    np.testing.assert_allclose(q.T @ q, np.eye(3), atol=1e-6)
    np.testing.assert_allclose(q @ (q.T @ p), p, atol=1e-5)  # p lies in q's span


def test_factors_meet_the_svd_bound_and_warm_start_converges_to_it() -> None:
    m = _low_rank_plus_noise(np.random.default_rng(1))
    s = np.linalg.svd(m.astype(np.float64), compute_uv=False)
    optimum = float(np.sqrt((s[2:] ** 2).sum()))  # Eckart-Young: best rank-2 error
    state = PowerSGDState([m.shape], rank=2)
    errors = []
    for _ in range(8):
        state.residual.clear()  # the same matrix every round: only Q carries over
        (approx,) = _one_member_round(state, [m])
        errors.append(float(np.linalg.norm(m - approx)))
    assert errors[0] >= optimum * (1 - 1e-5)  # no rank-2 matrix beats the SVD's
    assert errors[0] < float(np.linalg.norm(m))
    assert errors[-1] <= optimum * 1.001  # warm-started subspace iteration reaches it
    assert errors[-1] < errors[0]


def test_error_feedback_carries_what_rank_r_missed_into_the_next_round() -> None:
    rng = np.random.default_rng(2)
    shapes = [(16, 8), (8,), (4, 3, 2)]
    state = PowerSGDState(shapes, rank=1)
    assert state.compressed == [0, 2]
    total_in = [np.zeros(s, np.float64) for s in shapes]
    total_out = [np.zeros(s, np.float64) for s in shapes]
    for _ in range(4):
        grads = [rng.standard_normal(s).astype(np.float32) for s in shapes]
        out = _one_member_round(state, grads)
        for a, b, g, o in zip(total_in, total_out, grads, out, strict=True):
            a += g
            b += o
    # Sent + still held back == everything that came in; the bias travels whole.
    for i in state.compressed:
        held = state.residual[i].reshape(shapes[i])
        np.testing.assert_allclose(total_out[i] + held, total_in[i], atol=1e-4)
    np.testing.assert_allclose(total_out[1], total_in[1], atol=1e-5)


def test_two_members_factors_average_to_the_factors_of_the_mean() -> None:
    rng = np.random.default_rng(3)
    ms = [rng.standard_normal((10, 6)).astype(np.float32) for _ in range(2)]
    states = [PowerSGDState([(10, 6)], rank=2) for _ in range(2)]
    assert np.array_equal(states[0].q[0], states[1].q[0])  # same seed, same initial Q
    mats = [s.matrices([m]) for s, m in zip(states, ms, strict=True)]
    firsts = [s.first_round([m], x) for s, m, x in zip(states, ms, mats, strict=True)]
    p_mean = [(firsts[0][0] + firsts[1][0]) / 2]
    np.testing.assert_allclose(p_mean[0], ((ms[0] + ms[1]) / 2) @ states[0].q[0], atol=1e-5)
    seconds = [s.second_round(x, p_mean) for s, x in zip(states, mats, strict=True)]
    q_mean = [(seconds[0][1][0] + seconds[1][1][0]) / 2]
    outs = [
        s.finish([m], x, sec[0], p_mean, q_mean)
        for s, m, x, sec in zip(states, ms, mats, seconds, strict=True)
    ]
    assert np.array_equal(outs[0][0], outs[1][0])  # every member steps on the same gradient
    assert np.array_equal(states[0].q[0], states[1].q[0])  # and keeps the same warm start
    p = seconds[0][0][0]
    np.testing.assert_allclose(outs[0][0], p @ p.T @ ((ms[0] + ms[1]) / 2), atol=1e-5)


def test_small_tensors_travel_whole_and_rank_must_be_positive() -> None:
    assert not compressible((5,), 4)
    assert not compressible((4, 4), 4)  # (4 + 4) * 4 >= 16: factors are not smaller
    assert compressible((64, 32), 4)
    with pytest.raises(ValueError, match="rank"):
        PowerSGDState([(4, 4)], rank=0)
