"""The swarm side shared by the training wrappers: rounds, state sharing, statistics.

:class:`SwarmLink` turns the client's calls (docs/peer.md) into what a training loop wants:
a round that either returns averaged arrays or reports why it failed (never raises a
swarm failure into the training loop), state published and loaded in the format of
:mod:`swarmavg.averaging.training.state`, and counters of what happened. It works on numpy
arrays only; the wrappers convert torch tensors.
"""

from __future__ import annotations

import logging
import math
import random
import time
import warnings
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from swarmavg.averaging.aggregation import MEAN, canonical_aggregation
from swarmavg.averaging.errors import (
    AveragingError,
    InvalidTensorsError,
    RoundClosedError,
    SchemaMismatchError,
    StateNotFoundError,
)
from swarmavg.averaging.group import MAX_GROUP_SIZE
from swarmavg.averaging.training.consensus import Provenance
from swarmavg.averaging.training.no_shows import NoShows
from swarmavg.averaging.training.progress import DHTLike
from swarmavg.averaging.training.state import (
    RUN_EXTRA,
    StateFormatError,
    TrainingState,
    pack_state,
    unpack_state,
)
from swarmavg.compression import get_codec

if TYPE_CHECKING:
    import torch

log = logging.getLogger(__name__)


class RoundResultLike(Protocol):
    """The fields of ``client.average``'s result the wrappers read."""

    tensors: list[Any]
    group_size: int
    peers: list[str]
    group_id: str
    partial: bool
    state_digests: dict[str, bytes]
    local_fraction: float


class SwarmClient(Protocol):
    """The client API (docs/peer.md, "The client"), as used by the training wrappers."""

    @property
    def dht(self) -> DHTLike: ...

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
        aggregation: str = "mean",
        max_group_size: int | None = None,
    ) -> RoundResultLike: ...

    def publish_state(self, tensors: Sequence[Any], metadata: Any) -> Any: ...

    def load_state(self, timeout: float = 60.0) -> tuple[Any, list[Any]]: ...

    def status(self) -> dict[str, Any]: ...


def group_room(known: int) -> int:
    """The most members a round that counted ``known`` peers in the progress records takes.

    ``known`` is what the round waits for, not a cap: a newcomer's first record reaches
    some members before others, and a member that has not read it yet must still take the
    group its leader formed with the newcomer, or that round fails for it and leaves a
    part of the others' round without its values (partial). A quarter more, at least two.
    """
    return min(MAX_GROUP_SIZE, known + max(2, math.ceil(known / 4)))


LOAD_ATTEMPTS = 3
REPAIR_RETRY_FIRST = 0.02
"""Seconds before the first retry of a download that waits for a state about to be
published (a repair's, a catch-up's): the holders publish right after their step, usually
within milliseconds of the round's end."""
REPAIR_RETRY_MAX = 1.0
DUE_STATE_WAIT = 5.0
"""Seconds a catch-up waits for the state of the swarm's epoch when it found an older one
(:meth:`SwarmLink.load`'s ``at_least``): its advertisement follows its publication within
one DHT store; the bound covers members that publish less often than every epoch."""


def _is_no_state(exc: Exception) -> bool:
    """Nobody has published state: retrying cannot help (the client's ``NoStateError`` is one)."""
    return isinstance(exc, StateNotFoundError)


MIN_AVERAGED_FRACTION = 0.5
"""A partial round's result is applied only when at least this share of its elements came
back averaged (``1 - local_fraction``, the member's own observation).

Why apply a partial result at all: its un-averaged elements hold this member's own values,
exactly what a failed round steps with, so for them it is a local step, and the rest is
the group's average. Why not always: a round that averaged little (a reducer that answered
inconsistently for a large part, several members lost) moves this member away from the
group for little gain; stepping locally then is as good and is what the member reports.
Members that stepped differently are brought back to one state by the next round's state
digests (docs/training.md, "One shared state")."""


class SwarmRoundWarning(UserWarning):
    """A round failed and the wrapper stepped with local values instead."""


@dataclass
class RoundStats:
    """Counters of one wrapper's rounds (in this process).

    Attributes:
        rounds: rounds attempted.
        failed: rounds that raised a swarm error (the step used local values).
        partial: rounds that finished with ``partial=True``.
        partial_skipped: of those, the rounds whose result was not applied: more than
            ``1 - min_averaged_fraction`` of it kept local values (the step used local
            values, as for a failed round; ``failed`` does not count them).
        group_sizes: the group size of every successful round, in order.
        seconds: wall time spent inside ``average`` calls.
        states_published, states_loaded: state sharing calls that succeeded.
        last_error: the message of the most recent failure.
        diverged: rounds in which this process's shared state differed from the majority
            of the group (docs/training.md, "One shared state").
        repairs: of those, the rounds after which this process held the majority's state
            again (it loaded the holders' post-step state, or, with
            ``average="parameters"``, the round's average replaced its parameters).
        repair_failures: the others: no matching state could be loaded by the deadline
            (the step then used the round's result as usual; the next round retries).
        repair_seconds: wall time spent repairing (downloads and their retries).
        served: rounds in which this process held the majority's state, some member
            differed, and this process published its post-step state for it.
        last_repair_error: why the most recent repair failed.
        rejoins: times this process, already training, adopted the swarm's epoch after
            it had lost it: it was behind (and loaded the swarm's state) or ahead of the
            swarm's majority, e.g. after global steps alone (docs/training.md, "Staying
            in one swarm"). The initial catch-up of a newcomer is not one.
        final_agreement: what ``close()`` did to end with the same parameters as the
            others that stopped with it (docs/training.md, "Finishing a run"): ``""``
            (not closed yet, or ``final_round=False``), ``"alone"`` (no other live
            process), ``"identical"`` (every other one reported the same state: nothing to
            average), ``"averaged"`` (the final round ran; the parameters are its mean),
            ``"partial"`` (it ran but was partial), ``"failed"`` (it did not gather a group
            within ``final_timeout``: the parameters are this process's own).
        final_group_size: members of the final round (0: it did not run or failed).
        late_merges: times this process (a DiLoCo ``pace``) found the swarm past the outer
            step its inner work was for and carried that work onto the swarm's anchor
            (:mod:`~swarmavg.averaging.training.late_work`).
        late_discards: times it dropped such work instead (too stale, or ahead alone).
        left_out: of the failed rounds, those that closed without this process: its group
            averaged before it joined (``RoundClosedError``), so the others are stepping
            (:mod:`~swarmavg.averaging.training.left_out`).
    """

    rounds: int = 0
    failed: int = 0
    partial: int = 0
    partial_skipped: int = 0
    group_sizes: list[int] = field(default_factory=list)
    seconds: float = 0.0
    states_published: int = 0
    states_loaded: int = 0
    last_error: str = ""
    diverged: int = 0
    repairs: int = 0
    repair_failures: int = 0
    repair_seconds: float = 0.0
    served: int = 0
    last_repair_error: str = ""
    rejoins: int = 0
    final_agreement: str = ""
    final_group_size: int = 0
    late_merges: int = 0
    late_discards: int = 0
    left_out: int = 0


def swarm_errors() -> tuple[type[Exception], ...]:
    """Errors that mean "this round failed", not "the caller has a bug".

    The client's ``SwarmError`` derives from the layer's ``AveragingError``, so one class
    covers errors raised in this process and those reported by the daemon.
    """
    return (AveragingError,)


def _validation_errors() -> tuple[type[Exception], ...]:
    return (InvalidTensorsError,)


class SwarmLink:
    """One training wrapper's connection to the swarm.

    Args:
        client: a connected client (``swarmavg.peer.connect()``).
        run_id: the training run; every key it averages under starts with it.
        codec: codec name for every round (None: the daemon's default).
        aggregation: aggregation rule of every round (``"mean"``, ``"centered-clip"``,
            ``"trimmed-mean"``, parameters in the name); checked here, so that a wrong
            name fails when the wrapper is built rather than at its first round.
        timeout: seconds one round may take, matchmaking included.
        min_group_size: fewer peers than this make a round fail (then the step is local).
        state_timeout: seconds ``load_state`` may take.
    """

    def __init__(
        self,
        client: SwarmClient,
        run_id: str,
        *,
        codec: str | None,
        timeout: float,
        min_group_size: int,
        state_timeout: float,
        aggregation: str = MEAN,
    ) -> None:
        self.aggregation = canonical_aggregation(aggregation)  # ValueError listing the rules
        if timeout <= 0 or state_timeout <= 0:
            raise ValueError("timeouts must be positive")
        if min_group_size < 1:
            raise ValueError(f"min_group_size must be >= 1, got {min_group_size}")
        if codec is not None:
            get_codec(codec)  # a misspelt name fails here, not at the first round with a peer
        self.client = client
        self.run_id = run_id
        self.codec = codec
        self.timeout = timeout
        self.min_group_size = min_group_size
        self.state_timeout = state_timeout
        self.min_averaged_fraction = MIN_AVERAGED_FRACTION
        """See :data:`MIN_AVERAGED_FRACTION`; 0 applies every partial result, 1 none."""
        self.stats = RoundStats()
        self.no_shows = NoShows()
        """Daemons that missed a round the progress records expected them at; the
        wrapper's tracker shares it, so they stop counting until they report anew."""

    def average(
        self,
        arrays: list[np.ndarray],
        *,
        key: str,
        weight: float,
        group_size: int | None,
        warn: bool = True,
        state_digest: bytes | None = None,
        expected: Mapping[str, float] | None = None,
    ) -> RoundResultLike | None:
        """Run one round; None when it failed (a warning says why, unless ``warn`` is False:
        a background thread leaves the warning to the thread that applies the result).

        Invalid input (NaN/Inf gradients, ...) is the caller's bug and is raised, not
        turned into a local step. What other peers cause is a failed round: a schema that
        differs from theirs, or a ``group_size`` read from more progress records than one
        group can hold (clamped to ``MAX_GROUP_SIZE``, with a log line).

        ``expected``: the daemons ``group_size`` was counted from, each with the time of
        its newest record (``GlobalProgress.members()``). Those a round closes without are
        remembered in :attr:`no_shows`, so a dead daemon whose records linger is waited for
        once, not every round until its records expire.

        Thread-safe as far as the client is: the overlap mode calls it from its worker.
        """
        self.stats.rounds += 1
        started = time.monotonic()
        if group_size is not None and group_size > MAX_GROUP_SIZE:
            # Progress records come from other peers: forged ones must not make the
            # round's own arguments invalid.
            log.warning(
                "the swarm's progress names %d peers, more than a group holds; "
                "expecting %d in round %s",
                group_size,
                MAX_GROUP_SIZE,
                key,
            )
            group_size = MAX_GROUP_SIZE
        options: dict[str, Any] = {} if state_digest is None else {"state_digest": state_digest}
        if self.aggregation != MEAN:
            options["aggregation"] = self.aggregation
        try:
            result = self.client.average(
                arrays,
                key=f"{self.run_id}.{key}",
                weight=weight,
                group_size=group_size,
                max_group_size=None if group_size is None else group_room(group_size),
                min_group_size=min(self.min_group_size, group_size or self.min_group_size),
                timeout=self.timeout,
                codec=self.codec,
                **options,
            )
        except SchemaMismatchError as exc:  # other peers' layout: not this caller's bug
            self._failed(key, exc, warn, stacklevel=4)
            return None
        except _validation_errors():
            raise
        except swarm_errors() as exc:
            if isinstance(exc, RoundClosedError):
                self.stats.left_out += 1
            self._failed(key, exc, warn, stacklevel=4)
            return None
        finally:
            self.stats.seconds += time.monotonic() - started
        self.stats.group_sizes.append(int(result.group_size))
        if expected and group_size is not None and result.group_size < group_size:
            missed = self.no_shows.note(expected, result.peers)
            if missed:
                log.info(
                    "round %s closed with %d of the %d peers the progress named; not waiting "
                    "for %s again until they report: %s",
                    key,
                    result.group_size,
                    group_size,
                    "it" if len(missed) == 1 else "them",
                    ", ".join(p[:12] for p in missed),
                )
        if result.partial:
            self.stats.partial += 1
            averaged = 1.0 - float(result.local_fraction)
            if averaged < self.min_averaged_fraction:
                self.stats.partial_skipped += 1
                self.stats.last_error = (
                    f"partial round: only {averaged:.0%} averaged, below "
                    f"min_averaged_fraction {self.min_averaged_fraction:.0%}"
                )
                log.warning("round %s not applied: %s", key, self.stats.last_error)
                if warn:
                    warnings.warn(
                        f"averaging round {key!r} {self.stats.last_error}; stepping with "
                        "local values",
                        SwarmRoundWarning,
                        stacklevel=3,
                    )
                return None
            log.warning(
                "round %s was partial (%.0f%% averaged; a peer failed or answered "
                "inconsistently): applied",
                key,
                100 * averaged,
            )
        return result

    def agree(
        self,
        arrays: list[np.ndarray],
        *,
        key: str,
        group_size: int,
        timeout: float,
        digest: bytes,
    ) -> RoundResultLike | None:
        """The final agreement round of ``close()`` (docs/training.md, "Finishing a run"):
        every member gets the plain mean of the members' ``arrays`` (equal weights, codec
        ``none``: the run's result is not quantised; the run's aggregation rule), the same
        bytes on every member, and every member's ``digest`` of its arrays. None, logged,
        when it failed; never raises (it runs while the process is leaving). Not counted
        in :attr:`stats`' rounds.
        """
        options: dict[str, Any] = {"state_digest": digest}
        if self.aggregation != MEAN:
            options["aggregation"] = self.aggregation
        size = max(2, min(group_size, MAX_GROUP_SIZE))
        try:
            return self.client.average(
                arrays,
                key=f"{self.run_id}.{key}",
                weight=1.0,
                group_size=size,
                max_group_size=group_room(size),
                min_group_size=2,
                timeout=timeout,
                codec="none",
                **options,
            )
        except (*swarm_errors(), *_validation_errors()) as exc:
            log.info("final round %s failed: %s: %s", key, type(exc).__name__, exc)
            return None

    def _failed(self, key: str, exc: Exception, warn: bool, stacklevel: int) -> None:
        """Count a failed round and say why (a warning unless ``warn`` is False)."""
        self.stats.failed += 1
        self.stats.last_error = f"{type(exc).__name__}: {exc}"
        log.info("round %s failed: %s", key, self.stats.last_error)
        if warn:
            warnings.warn(
                f"averaging round {key!r} failed ({self.stats.last_error}); "
                "stepping with local values",
                SwarmRoundWarning,
                stacklevel=stacklevel,
            )

    def publish(self, state: TrainingState) -> bool:
        """Serve ``state`` to late joiners; False (with a log line) when the daemon refused."""
        return self.publish_packed(*pack_state(state))

    def publish_packed(self, metadata: dict[str, Any], arrays: list[np.ndarray]) -> bool:
        """:meth:`publish` of a state :func:`~swarmavg.averaging.training.state.pack_state`
        already flattened (a snapshot: the arrays are copies), from any thread.

        The state is stamped with this link's training run: a daemon serves one state,
        whichever run published it, and :meth:`load` and :meth:`load_round_state` tell
        this run's from another's by it.
        """
        extra = metadata.get("extra")
        metadata = {**metadata, "extra": {**(extra or {}), RUN_EXTRA: self.run_id}}
        try:
            self.client.publish_state(arrays, metadata)
        except _validation_errors():
            raise
        except swarm_errors() as exc:
            log.warning("could not publish state: %s", exc)
            return False
        self.stats.states_published += 1
        return True

    def load(
        self,
        kind: str,
        like: Sequence[torch.Tensor],
        *,
        expect_published: bool = False,
        at_least: int | None = None,
    ) -> TrainingState | None:
        """The newest state in the run; None when nobody has one or it does not fit.

        A download can fail because its donor published a newer version meanwhile (its
        old chunks are gone); it is retried a few times, within ``state_timeout`` in all.

        Args:
            expect_published: the swarm is past an epoch whose state its members publish,
                so "nobody published state" means the first one is still on its way (a
                member reports its new epoch while its publish runs in the background):
                that answer is retried after a capped, jittered pause until
                ``state_timeout`` instead of ending the load at once.
            at_least: the epoch whose state is due (the swarm stepped to it and its
                members publish it). A donor serves a new state at once and advertises it
                right after (averaging/state/sharer.py), so a download in between finds the
                state before it: an older one is kept and the download retried, for at
                most :data:`DUE_STATE_WAIT` seconds, then the newest found is returned.
        """
        state = self._load_newest(kind, like, expect_published)
        if state is None or at_least is None or state.epoch >= at_least:
            return state
        give_up = time.monotonic() + min(DUE_STATE_WAIT, self.state_timeout)
        pause = REPAIR_RETRY_FIRST
        while (left := give_up - time.monotonic()) > 0 and state.epoch < at_least:
            time.sleep(min(pause * random.uniform(0.5, 1.0), left))
            pause = min(pause * 2, REPAIR_RETRY_MAX)
            newer = self._load_newest(kind, like, expect_published=False)
            if newer is not None and newer.epoch >= state.epoch:
                state = newer
        if state.epoch < at_least:
            log.info("the state of epoch %d did not come; taking epoch %d's", at_least, state.epoch)
        return state

    def _load_newest(
        self, kind: str, like: Sequence[torch.Tensor], expect_published: bool
    ) -> TrainingState | None:
        """One :meth:`load` of the freshest state served now, retried as it says."""
        deadline = time.monotonic() + self.state_timeout
        failures = 0
        pause = REPAIR_RETRY_FIRST
        while (left := deadline - time.monotonic()) > 0:
            try:
                metadata, arrays = self.client.load_state(timeout=left)
                break
            except swarm_errors() as exc:
                if expect_published and _is_no_state(exc):
                    log.debug("no state published yet (%s); retrying", exc)
                    time.sleep(min(pause * random.uniform(0.5, 1.0), max(0.0, left)))
                    pause = min(pause * 2, REPAIR_RETRY_MAX)
                    continue
                failures += 1
                log.warning("could not load state from the swarm (try %d): %s", failures, exc)
                if failures == LOAD_ATTEMPTS or _is_no_state(exc):
                    return None
        else:
            log.warning("could not load state from the swarm within %.0f s", self.state_timeout)
            return None
        try:
            state = unpack_state(metadata, [np.asarray(a) for a in arrays], kind=kind, like=like)
        except StateFormatError as exc:
            log.warning("ignoring the swarm's state: %s", exc)
            return None
        if (run := state.training_run()) not in (None, self.run_id):
            log.warning("ignoring the swarm's state: it is training run %r's", run)
            return None
        self.stats.states_loaded += 1
        return state

    def load_round_state(
        self, kind: str, like: Sequence[torch.Tensor], expected: Provenance
    ) -> tuple[TrainingState | None, str]:
        """The holders' post-step state of one round (a repair); ``(None, why)`` when no
        state with provenance ``expected`` could be loaded within ``state_timeout``.

        The holders publish right after their step, so the first tries usually find the
        previous state still advertised: every download that names another provenance,
        finds nothing, or fails is retried after a capped, jittered pause until the
        deadline. Content addressing makes a retry of an unchanged state cost no chunks.
        A state of this training run and a later epoch ends the repair at once: a download
        returns the freshest state, so the one of ``expected.epoch`` will not be served
        again (the holders stepped on without this member); waiting out ``state_timeout``
        would only stall the training loop before the next round, which repairs or catches
        up anyway. Another run's state on the same daemons is only not yet replaced.
        """
        deadline = time.monotonic() + self.state_timeout
        pause = REPAIR_RETRY_FIRST
        why = "no attempt made"
        while (left := deadline - time.monotonic()) > 0:
            try:
                metadata, arrays = self.client.load_state(timeout=left)
                state = unpack_state(
                    metadata, [np.asarray(a) for a in arrays], kind=kind, like=like
                )
            except _validation_errors():
                raise
            except swarm_errors() as exc:
                why = f"{type(exc).__name__}: {exc}"
            except StateFormatError as exc:
                why = f"unusable state: {exc}"
            else:
                found = Provenance.from_extra(state.extra)
                if found == expected and state.epoch == expected.epoch:
                    self.stats.states_loaded += 1
                    return state, ""
                run = state.training_run()
                if run != self.run_id:
                    why = f"the freshest state is training run {run!r}'s"
                else:
                    why = f"the freshest state is of epoch {state.epoch}, provenance {found}"
                    if state.epoch > expected.epoch:
                        return None, f"{why}: the holders moved on"
            log.debug("repair download: %s; retrying", why)
            time.sleep(min(pause * random.uniform(0.5, 1.0), max(0.0, deadline - time.monotonic())))
            pause = min(pause * 2, REPAIR_RETRY_MAX)
        return None, why

    def bytes_sent(self) -> int | None:
        """Bytes the local daemon has sent to other peers (all rounds), when it reports it."""
        try:
            status = self.client.status()
        except swarm_errors():
            return None
        value = status.get("bytes_sent") if isinstance(status, dict) else None
        return int(value) if isinstance(value, int) else None


__all__ = ["RoundStats", "SwarmClient", "SwarmLink", "SwarmRoundWarning", "swarm_errors"]
