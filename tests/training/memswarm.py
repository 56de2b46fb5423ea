"""An in-memory swarm with the client's API (docs/peer.md), for the wrappers' state-machine tests.

It is the seam where the fast tests inject faults (a round that fails, a state that is
missing, a forged answer) without daemons; the same wrappers run against real daemons in
``test_collaborative_daemons.py``. Rounds are matched by key like the real matchmaking: a
round closes when ``group_size`` callers joined, or at its timeout with at least
``min_group_size``; every member gets ``sum(w_i x_i) / sum(w_i)`` and every member's
``state_digest``. Arguments are checked by the client's rules (``RoundRequest.build``), so a
wrapper that passes an invalid one fails here as it would against a daemon.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from swarmavg.averaging.errors import InvalidRequestError
from swarmavg.averaging.request import RoundRequest, check_finite
from swarmavg.peer.client.errors import (
    NoGroupError,
    NoStateError,
    RoundClosedError,
    ValidationError,
)


@dataclass
class Result:
    tensors: list[Any]
    group_size: int
    peers: list[str]
    group_id: str
    partial: bool = False
    state_digests: dict[str, bytes] = field(default_factory=dict)
    local_fraction: float = 0.0


@dataclass
class _Round:
    group_size: int
    members: dict[str, tuple[list[np.ndarray], float]] = field(default_factory=dict)
    digests: dict[str, bytes] = field(default_factory=dict)
    result: list[np.ndarray] | None = None
    closed: bool = False

    def close(self) -> None:
        total = sum(w for _, w in self.members.values())
        count = len(next(iter(self.members.values()))[0])
        self.result = [
            (
                sum(w * arrays[i].astype(np.float64) for arrays, w in self.members.values()) / total
            ).astype(np.float32)
            for i in range(count)
        ]
        self.closed = True


class MemorySwarm:
    """Shared state of the in-memory swarm; ``client(peer_id)`` gives a client."""

    def __init__(self) -> None:
        self.cond = threading.Condition()
        self.dht: dict[str, dict[Any, tuple[Any, float]]] = {}
        self.rounds: dict[str, _Round] = {}
        self.states: dict[str, tuple[Any, list[np.ndarray], int]] = {}
        self.fail_keys: set[str] = set()
        self.before_failure: Callable[[str], None] | None = None
        """Called (outside the lock) with the key of a round about to fail by injection."""
        self.raise_for: dict[str, Exception] = {}
        """key -> the error its round raises (another failure than ``fail_keys``')."""
        self.forge: Callable[[str, Result], Result] | None = None
        """Called with (caller, result) before a round's result is handed out: a hostile
        leader's answer."""
        self.publish_counter = 0
        self.publish_gate: threading.Event | None = None
        """When an event, every publish waits for it: a state still on its way to the
        daemon while its publisher's new epoch is already reported."""
        self.on_no_state: Callable[[str], None] | None = None
        """Called (outside the lock) with the caller of a load that found no state."""
        self.calls: list[tuple[str, str, float, int | None]] = []

    def client(self, peer_id: str) -> MemoryClient:
        return MemoryClient(self, peer_id)


class _DHT:
    def __init__(self, swarm: MemorySwarm) -> None:
        self.swarm = swarm

    def store(self, key: str, value: Any, ttl: float = 60.0, subkey: Any = None) -> bool:
        with self.swarm.cond:
            self.swarm.dht.setdefault(key, {})[subkey] = (value, time.monotonic() + ttl)
        return True

    def get(self, key: str) -> Any:
        now = time.monotonic()
        with self.swarm.cond:
            entries = self.swarm.dht.get(key, {})
            live = {k: v for k, (v, expiry) in entries.items() if expiry > now}
        if not live:
            return None
        if list(live) == [None]:
            return live[None]
        return live


class MemoryClient:
    def __init__(self, swarm: MemorySwarm, peer_id: str) -> None:
        self.swarm = swarm
        self.peer_id = peer_id
        self.dht = _DHT(swarm)

    def status(self) -> dict[str, Any]:
        return {"peer_id": self.peer_id, "bytes_sent": 0}

    def average(
        self,
        tensors: Sequence[Any],
        key: str,
        weight: float = 1.0,
        group_size: int | None = None,
        min_group_size: int = 2,
        timeout: float = 30.0,
        codec: str | None = None,
        state_digest: bytes | None = None,
        max_group_size: int | None = None,
    ) -> Result:
        try:  # the client's own checks, before anything is "sent"
            request = RoundRequest.build(
                key=key,
                weight=weight,
                timeout=timeout,
                group_size=group_size,
                min_group_size=min_group_size,
                codec=codec,
                state_digest=state_digest,
                max_group_size=max_group_size,
            )
            arrays = [np.array(t, dtype=np.float32, copy=True) for t in tensors]
            check_finite(arrays)
        except InvalidRequestError as exc:
            raise ValidationError(str(exc)) from None
        swarm = self.swarm
        deadline = time.monotonic() + timeout
        with swarm.cond:
            swarm.calls.append((self.peer_id, key, weight, group_size))
            failing = key in swarm.fail_keys
            injected = swarm.raise_for.get(key)
        if failing:
            if swarm.before_failure is not None:
                swarm.before_failure(key)
            raise NoGroupError(f"injected failure for {key}")
        if injected is not None:
            raise injected
        with swarm.cond:
            rnd = swarm.rounds.setdefault(key, _Round(group_size or 16))
            if rnd.closed:
                raise RoundClosedError(f"round {key} closed before {self.peer_id} arrived")
            rnd.members[self.peer_id] = (arrays, weight)
            if request.state_digest:
                rnd.digests[self.peer_id] = request.state_digest
            if len(rnd.members) >= rnd.group_size:
                rnd.close()
                swarm.cond.notify_all()
            while not rnd.closed:
                left = deadline - time.monotonic()
                if left <= 0:
                    if len(rnd.members) >= min_group_size:
                        rnd.close()
                        swarm.cond.notify_all()
                        break
                    del rnd.members[self.peer_id]
                    rnd.digests.pop(self.peer_id, None)
                    raise NoGroupError(f"only {len(rnd.members) + 1} peers for {key}")
                swarm.cond.wait(left)
            assert rnd.result is not None
            result = Result(
                tensors=[r.copy() for r in rnd.result],
                group_size=len(rnd.members),
                peers=sorted(rnd.members),
                group_id=key.encode().hex(),
                state_digests=dict(rnd.digests),
            )
        return result if swarm.forge is None else swarm.forge(self.peer_id, result)

    def publish_state(self, tensors: Sequence[Any], metadata: Any) -> None:
        gate = self.swarm.publish_gate
        if gate is not None:
            assert gate.wait(60), "the publish was never let through"
        with self.swarm.cond:
            self.swarm.publish_counter += 1
            self.swarm.states[self.peer_id] = (
                metadata,
                [np.array(t, copy=True) for t in tensors],
                self.swarm.publish_counter,
            )

    def load_state(self, timeout: float = 60.0) -> tuple[Any, list[np.ndarray]]:
        with self.swarm.cond:
            donors = [s for p, s in self.swarm.states.items() if p != self.peer_id]
            if donors:
                metadata, arrays, _ = max(donors, key=lambda s: s[2])
                return metadata, [a.copy() for a in arrays]
        if self.swarm.on_no_state is not None:
            self.swarm.on_no_state(self.peer_id)
        raise NoStateError("nobody published state")
