"""One machine's ranks as one swarm peer: the collectives of the hierarchical mode.

A :class:`LocalGroup` wraps a ``torch.distributed`` process group whose ranks share a
machine (and a daemon). The training wrappers use it to reduce the ranks' contributions
onto one rank, the *leader*, which alone talks to the daemon, and to broadcast the
leader's outcome and state back (docs/training.md, "Hierarchical mode").

Every collective here is asynchronous and waited on with a deadline: a rank that stops, or
a leader stuck past its round, makes the others fail with :class:`LocalGroupError` instead
of hanging. (The process group's own timeout, given to ``init_process_group`` or
``new_group``, bounds the collective inside the backend too; keep it at least as long.)
The group is unusable after such a failure (the backend's state is unknown), so the error
says so.

Tensors travel on the CPU with gloo and on the current CUDA device with NCCL. torch is
imported inside functions only, like the rest of the training package.
"""

from __future__ import annotations

import io
from collections.abc import Sequence
from datetime import timedelta
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    import torch
    import torch.distributed


class LocalGroupError(RuntimeError):
    """A collective of the local group failed or passed its deadline (the group cannot be
    used any more), or the leader's work failed and this rank mirrors that failure."""


class LocalGroup:
    """The ranks of one machine that average through one daemon.

    Args:
        process_group: the ``torch.distributed`` group of this machine's ranks (None: the
            default group, which the caller initialised with ``init_process_group``).
        leader: the group rank that talks to the daemon (default 0).
        timeout: seconds a rank waits for one collective; the wrappers wait longer for the
            leader's outcome (its round and state loading, see ``outcome_timeout``).

    Raises:
        RuntimeError: ``torch.distributed`` is not available or not initialised.
        ValueError: ``leader`` is not a rank of the group, or ``timeout`` is not positive.
    """

    def __init__(
        self,
        process_group: torch.distributed.ProcessGroup | None = None,
        *,
        leader: int = 0,
        timeout: float = 60.0,
    ) -> None:
        import torch.distributed as dist

        if not dist.is_available() or not dist.is_initialized():
            raise RuntimeError(
                "the hierarchical mode needs torch.distributed initialised: call "
                "torch.distributed.init_process_group(...) first (docs/training.md)"
            )
        if timeout <= 0:
            raise ValueError(f"timeout must be positive, got {timeout}")
        group = process_group if process_group is not None else dist.group.WORLD
        if group is None:
            raise RuntimeError("torch.distributed has no default group")
        self.group: torch.distributed.ProcessGroup = group
        self.size = dist.get_world_size(self.group)
        self.rank = dist.get_rank(self.group)
        if self.rank < 0:
            raise ValueError("this process is not a member of the given process group")
        if not 0 <= leader < self.size:
            raise ValueError(
                f"leader must be a rank of the group (0..{self.size - 1}), got {leader}"
            )
        self.leader = leader
        self.timeout = timeout
        # Collectives name ranks of the default group, not of this group.
        self._leader_global = dist.get_global_rank(self.group, leader)
        self._device = _device_of(dist.get_backend(self.group))
        self._broken = ""

    @property
    def is_leader(self) -> bool:
        """Whether this rank talks to the daemon."""
        return self.rank == self.leader

    # ------------------------------------------------------------------ collectives

    def sum_int(self, value: int) -> int:
        """The sum of ``value`` over the group's ranks (on every rank)."""
        import torch
        import torch.distributed as dist

        buf = torch.tensor([value], dtype=torch.int64, device=self._device)
        self._wait(dist.all_reduce(buf, group=self.group, async_op=True), "sum", self.timeout)
        return int(buf.item())

    def broadcast_int(self, value: int, timeout: float | None = None) -> int:
        """The leader's ``value`` on every rank."""
        import torch
        import torch.distributed as dist

        buf = torch.tensor([value], dtype=torch.int64, device=self._device)
        work = dist.broadcast(buf, self._leader_global, group=self.group, async_op=True)
        self._wait(work, "broadcast", self.timeout if timeout is None else timeout)
        return int(buf.item())

    def reduce_sum(self, tensors: Sequence[torch.Tensor]) -> list[torch.Tensor] | None:
        """The element-wise sum of every rank's ``tensors``, as float32 tensors on the leader
        (None on the other ranks). The inputs are not modified."""
        import torch.distributed as dist

        if not tensors:
            return [] if self.is_leader else None
        flat = self._flatten(tensors)
        work = dist.reduce(flat, self._leader_global, group=self.group, async_op=True)
        self._wait(work, "reduce", self.timeout)
        return self._unflatten(flat, tensors) if self.is_leader else None

    def broadcast_object(self, obj: Any, timeout: float | None = None) -> Any:
        """The leader's ``obj`` (anything ``torch.save`` writes: tensors, dicts, strings) on
        every rank; ``obj`` is ignored on the other ranks. Tensors arrive on the CPU."""
        import torch

        data = b""
        if self.is_leader:
            out = io.BytesIO()
            torch.save(obj, out)
            data = out.getvalue()
        size = self.broadcast_int(len(data), timeout)
        buf = torch.empty(size, dtype=torch.uint8, device=self._device)
        if self.is_leader:
            buf.copy_(torch.frombuffer(bytearray(data), dtype=torch.uint8))
        import torch.distributed as dist

        work = dist.broadcast(buf, self._leader_global, group=self.group, async_op=True)
        self._wait(work, "broadcast", self.timeout)
        if self.is_leader:
            return obj
        payload = io.BytesIO(buf.cpu().numpy().tobytes())
        return torch.load(payload, map_location="cpu", weights_only=True)

    # ------------------------------------------------------------------ helpers

    def _wait(self, work: Any, what: str, timeout: float) -> None:
        if self._broken:
            raise LocalGroupError(f"the local group failed earlier ({self._broken})")
        try:
            work.wait(timedelta(seconds=timeout))
        except RuntimeError as exc:
            self._broken = f"{what} on rank {self.rank}: {exc}"
            raise LocalGroupError(
                f"local group rank {self.rank}: the {what} did not complete within "
                f"{timeout:.0f}s or failed ({exc}); a rank stopped or the leader is stuck. "
                "The group cannot be used any more: restart the ranks"
            ) from exc

    def _flatten(self, tensors: Sequence[torch.Tensor]) -> torch.Tensor:
        import torch

        return torch.cat(
            [t.detach().to(device=self._device, dtype=torch.float32).reshape(-1) for t in tensors]
        )

    def _unflatten(self, flat: torch.Tensor, like: Sequence[torch.Tensor]) -> list[torch.Tensor]:
        out: list[torch.Tensor] = []
        offset = 0
        for t in like:
            n = t.numel()
            out.append(flat[offset : offset + n].view(t.shape).to(t.device))
            offset += n
        return out


def _device_of(backend: str) -> torch.device:
    """Where this backend's tensors must live: NCCL moves CUDA tensors only."""
    import torch

    if str(backend).lower() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def resolve_local_group(
    process_group: LocalGroup | torch.distributed.ProcessGroup | str | None, leader: int
) -> LocalGroup | None:
    """The wrappers' ``process_group=`` argument as a :class:`LocalGroup` (None: no
    hierarchical mode). ``"world"`` is the default group; a :class:`LocalGroup` is taken
    as it is (its own leader and timeout).

    Raises:
        ValueError: a string other than ``"world"``, or a bad ``leader``.
        RuntimeError: ``torch.distributed`` is not initialised.
    """
    if process_group is None:
        return None
    if isinstance(process_group, LocalGroup):
        return process_group
    if isinstance(process_group, str):
        if process_group != "world":
            raise ValueError(
                f"process_group must be a torch.distributed group, a LocalGroup or 'world', "
                f"got {process_group!r}"
            )
        return LocalGroup(None, leader=leader)
    return LocalGroup(process_group, leader=leader)


def outcome_timeout(averaging_timeout: float, state_timeout: float) -> float:
    """How long a rank waits for the leader's outcome: a round, then up to two state loads
    (a repair and a catch-up) and a publication, with a margin."""
    return averaging_timeout + 2 * state_timeout + 30.0


__all__ = ["LocalGroup", "LocalGroupError", "outcome_timeout", "resolve_local_group"]
