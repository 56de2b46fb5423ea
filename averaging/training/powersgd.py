"""PowerSGD gradient averaging (Vogels et al. 2019): rank-r factors through two rounds.

Each gradient matrix ``M`` (a tensor of 2 or more dimensions, viewed as
``shape[0] x rest``) plus this member's error-feedback residual is compressed to rank r
by one step of subspace iteration, warm-started from the last round's ``Q``
(Algorithm 1 of the paper):

1. ``P = M Q`` on every member; round one averages the ``P`` s (with the tensors too small
   to compress, which travel whole in the same round). Since every member holds the same
   ``Q``, the mean of the ``P`` s is ``mean(M) Q``.
2. ``P`` is orthogonalised (Gram-Schmidt, float64) the same way on every member.
3. ``Q = M^T P`` on every member; round two averages the ``Q`` s: ``mean(M)^T P``.
4. The averaged gradient is ``P Q^T``; this member's residual becomes ``M - P Q^T`` (what
   the rank-r approximation missed of its own gradient), and ``Q`` is kept as the next
   round's warm start.

A matrix is compressed only where it saves bytes: ``(n + m) r < n m``. ``Q`` is shared
state (identical on members in step, part of the state digest and of the published state,
so a late joiner or a repairing member takes it over); the residuals are each member's
own. :class:`PowerSGDState` is the pure math (tested against numpy's SVD);
:class:`PowerSGDOptimizer` adds it to :class:`CollaborativeOptimizer`'s rounds.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import numpy as np

from swarmavg.averaging.training.collaborative import CollaborativeOptimizer
from swarmavg.averaging.training.digest import state_digest
from swarmavg.averaging.training.local_group import LocalGroup
from swarmavg.averaging.training.state import TrainingState
from swarmavg.averaging.training.swarm import RoundResultLike, SwarmClient

if TYPE_CHECKING:
    import torch
    import torch.distributed

    from swarmavg.averaging.run_records.progress import GlobalProgress


def orthogonalize(p: np.ndarray) -> np.ndarray:
    """Orthonormal columns spanning ``p``'s (modified Gram-Schmidt in float64; a column
    that vanishes stays zero)."""
    q = p.astype(np.float64, copy=True)
    for j in range(q.shape[1]):
        for i in range(j):
            q[:, j] -= (q[:, i] @ q[:, j]) * q[:, i]
        norm = math.sqrt(float(q[:, j] @ q[:, j]))
        q[:, j] = q[:, j] / norm if norm > 1e-30 else 0.0
    return q.astype(np.float32)


def matrix_shape(shape: Sequence[int]) -> tuple[int, int]:
    """The matrix a tensor is viewed as: ``shape[0] x (product of the rest)``."""
    return int(shape[0]), int(math.prod(shape[1:]))


def compressible(shape: Sequence[int], rank: int) -> bool:
    """Whether rank-``rank`` factors of a tensor of ``shape`` are smaller than it."""
    if len(shape) < 2:
        return False
    n, m = matrix_shape(shape)
    return (n + m) * rank < n * m


@dataclass
class PowerSGDState:
    """PowerSGD's state: the warm-start ``Q`` per compressed tensor (shared) and the
    error-feedback residual per compressed tensor (this member's own).

    Args:
        shapes: the gradient tensors' shapes, in order.
        rank: r, the factors' rank.
        seed: seeds the initial ``Q`` (every member must use the same).
    """

    shapes: list[tuple[int, ...]]
    rank: int = 4
    seed: int = 0
    q: dict[int, np.ndarray] = field(default_factory=dict)
    residual: dict[int, np.ndarray] = field(default_factory=dict)

    def __post_init__(self) -> None:
        if self.rank < 1:
            raise ValueError(f"rank must be >= 1, got {self.rank}")
        rng = np.random.default_rng(self.seed)
        for i in self.compressed:
            if i not in self.q:
                _, m = matrix_shape(self.shapes[i])
                self.q[i] = orthogonalize(rng.standard_normal((m, self.rank)))

    @property
    def compressed(self) -> list[int]:
        """Indices of the tensors sent as factors (the others travel whole)."""
        return [i for i, s in enumerate(self.shapes) if compressible(s, self.rank)]

    def matrices(self, grads: Sequence[np.ndarray]) -> dict[int, np.ndarray]:
        """Each compressed tensor's gradient plus residual, as a float32 matrix."""
        out = {}
        for i in self.compressed:
            m = np.asarray(grads[i], np.float32).reshape(matrix_shape(self.shapes[i]))
            r = self.residual.get(i)
            out[i] = m + r if r is not None else m.copy()
        return out

    def first_round(
        self, grads: Sequence[np.ndarray], matrices: dict[int, np.ndarray]
    ) -> list[np.ndarray]:
        """Round one's tensors: ``P = M Q`` per compressed tensor, the others whole."""
        return [
            matrices[i] @ self.q[i] if i in matrices else np.asarray(g, np.float32)
            for i, g in enumerate(grads)
        ]

    def second_round(
        self, matrices: dict[int, np.ndarray], averaged: Sequence[np.ndarray]
    ) -> tuple[dict[int, np.ndarray], dict[int, np.ndarray]]:
        """The orthogonalised mean ``P`` s and round two's ``Q = M^T P``, per tensor."""
        ps = {i: orthogonalize(np.asarray(averaged[i], np.float32)) for i in matrices}
        qs = {i: (matrices[i].T @ ps[i]).astype(np.float32) for i in matrices}
        return ps, qs

    def finish(
        self,
        grads: Sequence[np.ndarray],
        matrices: dict[int, np.ndarray],
        ps: dict[int, np.ndarray],
        first: Sequence[np.ndarray],
        second: Sequence[np.ndarray],
    ) -> list[np.ndarray]:
        """The averaged gradients; updates the residuals and the warm-start ``Q`` s.

        Args:
            ps: the orthogonalised ``P`` s (from :meth:`second_round`).
            first: round one's averaged tensors; second: round two's, one per compressed
                tensor in order.
        """
        out = [np.asarray(t, np.float32) for t in first]
        for j, i in enumerate(self.compressed):
            q = np.asarray(second[j], np.float32)
            approx = ps[i] @ q.T
            self.residual[i] = matrices[i] - approx
            self.q[i] = q.copy()
            out[i] = approx.reshape(self.shapes[i])
        return out

    def state_dict(self) -> dict[str, Any]:
        """The shared part (``q``) and this member's part (``residual``), as arrays."""
        return {
            "rank": self.rank,
            "q": {str(i): q.copy() for i, q in self.q.items()},
            "residual": {str(i): r.copy() for i, r in self.residual.items()},
        }

    def load_shared(self, q: dict[str, Any]) -> None:
        """Take over the shared ``Q`` s (a loaded state).

        Raises:
            ValueError: a ``Q`` of the wrong shape or a tensor that is not compressed.
        """
        loaded = {}
        for key, value in q.items():
            i = int(key)
            array = np.asarray(value.detach().cpu().numpy() if hasattr(value, "detach") else value)
            if i not in self.compressed or array.shape != self.q[i].shape:
                raise ValueError(f"PowerSGD state: Q {key} does not fit the model")
            loaded[i] = array.astype(np.float32)
        self.q.update(loaded)


@dataclass
class _TwoRounds:
    """The result of the two rounds, shaped like one round's for the wrapper."""

    tensors: list[Any]
    group_size: int
    peers: list[str]
    group_id: str
    partial: bool
    state_digests: dict[str, bytes]
    local_fraction: float = 0.0


class PowerSGDOptimizer(CollaborativeOptimizer):
    """``CollaborativeOptimizer`` that averages rank-r PowerSGD factors (module docstring).

    Args:
        rank: r (default 4).
        seed: seeds the initial ``Q`` (the same on every member).
        verbose: log the epoch, the swarm's samples/s and the time to the next global step
            at INFO, as :class:`CollaborativeOptimizer` does.
        process_group, local_leader: the hierarchical mode, as for
            :class:`CollaborativeOptimizer`: the ranks sum their gradients onto the leader,
            which compresses the machine's gradient (its error feedback is the machine's)
            and runs both rounds; every rank then takes the leader's parameters, optimizer
            state and ``Q``.
        others: as for :class:`CollaborativeOptimizer` (gradients mode only; the codec
            applies to the factors, ``none`` is a good choice).

    Each global step runs two rounds, ``grads.<epoch>.p`` and ``grads.<epoch>.q``, both
    with this member's state digest; a step whose second round fails is a local step and
    leaves ``Q`` and the residuals as they were (the member then differs from those whose
    rounds succeeded, and the next round's digests repair it).

    Raises:
        ValueError: as for :class:`CollaborativeOptimizer`, a ``rank`` below 1, or
            ``delay_updates=True`` (the two rounds of a step are sequential, and the
            residuals and ``Q`` of one step feed the next: use
            ``CollaborativeOptimizer(delay_updates=True)`` with a compressing codec
            such as ``uint8-blockwise`` to overlap rounds with compute).
    """

    KIND = "powersgd"

    def __init__(
        self,
        params: Iterable[Any],
        optimizer: torch.optim.Optimizer,
        client: SwarmClient | None,
        run_id: str,
        target_batch_size: int,
        batch_size_per_step: int,
        codec: str | None = None,
        *,
        rank: int = 4,
        seed: int = 0,
        aggregation: str = "mean",
        delay_updates: bool = False,
        averaging_timeout: float = 30.0,
        min_group_size: int = 2,
        progress_ttl: float = 30.0,
        publish_state_every: int = 1,
        load_state_on_start: bool = True,
        state_timeout: float = 60.0,
        max_wait: float = 1.0,
        peer_id: str | None = None,
        verbose: bool = False,
        process_group: LocalGroup | torch.distributed.ProcessGroup | str | None = None,
        local_leader: int = 0,
        final_round: bool = True,
        final_timeout: float | None = None,
    ) -> None:
        if delay_updates:
            raise ValueError(
                "PowerSGDOptimizer cannot delay its updates: each step's two rounds run one "
                "after the other and its residuals and Q feed the next step; use "
                "CollaborativeOptimizer(delay_updates=True) with a compressing codec "
                "(e.g. codec='uint8-blockwise') to overlap rounds with compute"
            )
        tensors = list(params)
        self.powersgd = PowerSGDState([tuple(p.shape) for p in tensors], rank=rank, seed=seed)
        super().__init__(
            tensors,
            optimizer,
            client,
            run_id,
            target_batch_size,
            batch_size_per_step,
            "gradients",
            codec,
            aggregation=aggregation,
            averaging_timeout=averaging_timeout,
            min_group_size=min_group_size,
            progress_ttl=progress_ttl,
            publish_state_every=publish_state_every,
            load_state_on_start=load_state_on_start,
            state_timeout=state_timeout,
            max_wait=max_wait,
            peer_id=peer_id,
            verbose=verbose,
            process_group=process_group,
            local_leader=local_leader,
            final_round=final_round,
            final_timeout=final_timeout,
        )

    def state_dict(self) -> dict[str, Any]:
        """As for CollaborativeOptimizer, plus the PowerSGD state (Q and residuals)."""
        state = super().state_dict()
        state["powersgd"] = self.powersgd.state_dict()
        return state

    def load_state_dict(self, state: dict[str, Any]) -> None:
        super().load_state_dict(state)
        saved = state.get("powersgd")
        if isinstance(saved, dict):
            self.powersgd.load_shared(saved.get("q", {}))
            self.powersgd.residual = {
                int(k): np.asarray(v, np.float32) for k, v in saved.get("residual", {}).items()
            }

    def _round(
        self,
        arrays: list[np.ndarray],
        key: str,
        weight: float,
        progress: GlobalProgress,
        digest: bytes,
    ) -> tuple[RoundResultLike | None, str]:
        if len(progress.round_members(self.tracker.peer_id)) <= 1:
            return None, ""
        state = self.powersgd
        matrices = state.matrices(arrays)
        first, error = super()._round(
            state.first_round(arrays, matrices), f"{key}.p", weight, progress, digest
        )
        if first is None:
            return None, error
        ps, local_qs = state.second_round(matrices, first.tensors)
        qs = [local_qs[i] for i in state.compressed]
        second: RoundResultLike | None = None
        if qs:
            # The second round expects the first one's members: a peer that missed the
            # first cannot join the second, and waiting for it would cost a window again.
            members = dataclasses.replace(progress, num_peers=first.group_size)
            second, error = super()._round(qs, f"{key}.q", weight, members, digest)
            if second is None:
                return None, error
        tensors = state.finish(
            arrays, matrices, ps, first.tensors, second.tensors if second else []
        )
        return _TwoRounds(
            tensors,
            first.group_size,
            list(first.peers),
            first.group_id,
            first.partial or bool(second and second.partial),
            dict(first.state_digests),
            # the step takes both rounds: it is as local as the more local of the two
            max(first.local_fraction, second.local_fraction if second else 0.0),
        ), ""

    def _shared_digest(self) -> bytes:
        return state_digest(
            self.params,
            {"optimizer": self.optimizer.state_dict(), "powersgd": self._shared_q()},
            self.epoch,
        )

    def _shared_q(self) -> dict[str, Any]:
        return {str(i): q for i, q in sorted(self.powersgd.q.items())}

    def _training_state(self, epoch: int) -> TrainingState:
        state = super()._training_state(epoch)
        import torch

        state.optimizers["powersgd"] = {
            k: torch.from_numpy(v.copy()) for k, v in self._shared_q().items()
        }
        return state

    def _take_state(self, state: TrainingState) -> None:
        super()._take_state(state)
        if "powersgd" in state.optimizers:
            self.powersgd.load_shared(state.optimizers["powersgd"])

    def _machine_state(self) -> dict[str, Any]:
        """Hierarchical mode: also the leader's ``Q`` s and residuals. Only the leader
        compresses (the residuals are the machine's error feedback), but every rank holds
        them, so that any rank's checkpoint (``state_dict``) is the machine's."""
        import torch

        state = super()._machine_state()
        state["powersgd"] = {
            "q": {k: torch.from_numpy(v.copy()) for k, v in self._shared_q().items()},
            "residual": {
                str(i): torch.from_numpy(r.copy()) for i, r in self.powersgd.residual.items()
            },
        }
        return state

    def _take_machine_state(self, state: Mapping[str, Any]) -> None:
        super()._take_machine_state(state)
        shared = state.get("powersgd")
        if isinstance(shared, Mapping):
            self.powersgd.load_shared(dict(shared.get("q", {})))
            self.powersgd.residual = {
                int(k): np.asarray(v.numpy() if hasattr(v, "numpy") else v, np.float32)
                for k, v in dict(shared.get("residual", {})).items()
            }


__all__ = [
    "PowerSGDOptimizer",
    "PowerSGDState",
    "compressible",
    "matrix_shape",
    "orthogonalize",
]
