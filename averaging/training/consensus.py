"""One shared state: who holds the majority's state after a round, who must repair (pure).

Every member of a training round attaches a digest of its shared state (the state that
must be identical on every member: :mod:`swarmavg.averaging.training.digest`), and the
round hands every member the digests of all (``result.state_digests``, the same map on
every member, since it comes from the group the leader formed). From that one map every
member computes the same verdict with :func:`judge`:

* the **majority digest** is the one most members attached; a tie goes to the smaller
  digest bytes, so every member breaks it the same way without talking to the others
  (PCCL compares state hashes every step in the same spirit);
* a member whose own digest is the majority's is a **holder**; when some member differs,
  the holders **serve**: they publish their post-step state, tagged with the round's
  :class:`Provenance`, right after their step;
* a member whose own digest differs **repairs**: it skips its own step and loads the
  holders' post-step state, accepting only a state whose provenance names this round.

Members that attached no digest (a plain client averaging under the same key) are left
out of the count. A verdict needs at least two digests; with fewer there is nobody to
compare with and every member just steps.

The rule trusts the group's map: a hostile leader can forge the other members' digests
(not a member's own entry, which every member checks) and make members repair for
nothing; such a repair fails, is counted, and training goes on.
"""

from __future__ import annotations

import enum
import hashlib
import struct
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any


class Role(enum.Enum):
    """What one member does with a round's result."""

    STEP = "step"
    """Nobody to compare with, or every member agrees: step as usual."""
    SERVE = "serve"
    """This member holds the majority's state and some member differs: step, then publish
    the post-step state (with its provenance) for the members that repair."""
    REPAIR = "repair"
    """This member's state differs from the majority's: skip the step and load the
    holders' post-step state instead."""


@dataclass(frozen=True)
class Verdict:
    """The outcome of :func:`judge` for one member.

    Attributes:
        role: what this member does.
        majority: the majority digest (empty when there were fewer than two digests).
        holders: peers (hex ids) whose digest is the majority's, sorted.
        differing: peers whose digest is another one, sorted.
    """

    role: Role
    majority: bytes
    holders: tuple[str, ...] = ()
    differing: tuple[str, ...] = ()


def majority_digest(digests: Mapping[str, bytes]) -> bytes | None:
    """The digest most members hold; a tie goes to the smaller digest bytes.

    Deterministic in the map's contents (not its order), so every member of a group gets
    the same answer. None for an empty map.
    """
    counts = Counter(digests.values())
    if not counts:
        return None
    return min(counts, key=lambda digest: (-counts[digest], digest))


def judge(digests: Mapping[str, bytes], mine: bytes) -> Verdict:
    """This member's verdict on a round whose members attached ``digests``.

    Args:
        digests: peer id hex -> digest, as the round returned them.
        mine: the digest of this process's own state (what it attached). It is compared
            itself, not this daemon's entry in ``digests``: a daemon that combines several
            local processes attaches its first caller's digest.
    """
    valid = {p: d for p, d in digests.items() if isinstance(d, bytes) and d}
    majority = majority_digest(valid)
    if majority is None or len(valid) < 2 or not mine:
        return Verdict(Role.STEP, b"")
    holders = tuple(sorted(p for p, d in valid.items() if d == majority))
    differing = tuple(sorted(p for p, d in valid.items() if d != majority))
    if mine != majority:
        role = Role.REPAIR
    elif differing:
        role = Role.SERVE
    else:
        role = Role.STEP
    return Verdict(role, majority, holders, differing)


@dataclass(frozen=True)
class Provenance:
    """Where a published training state comes from: the round step that produced it.

    Travels in the state's metadata (``TrainingState.extra``). A repairing member accepts
    a loaded state only when its provenance is the one it expects, so it never takes a
    state of another round, of another epoch, or one a member stepped alone.

    Attributes:
        epoch: the epoch the state belongs to (the round's epoch + 1).
        stepped_from: the majority digest of the state the step was applied to.
        group: the round's group id (hex).
    """

    epoch: int
    stepped_from: bytes
    group: str

    def to_extra(self) -> dict[str, Any]:
        """The msgpack-able form kept in ``TrainingState.extra["provenance"]``."""
        return {"epoch": self.epoch, "from": self.stepped_from, "group": self.group}

    @classmethod
    def from_extra(cls, extra: Mapping[str, Any]) -> Provenance | None:
        """Parse ``extra["provenance"]`` of a loaded state; None when absent or malformed."""
        raw = extra.get("provenance")
        if not isinstance(raw, Mapping):
            return None
        epoch, stepped_from, group = raw.get("epoch"), raw.get("from"), raw.get("group")
        if not isinstance(epoch, int) or isinstance(epoch, bool) or epoch < 0:
            return None
        if not isinstance(stepped_from, bytes) or not isinstance(group, str):
            return None
        return cls(epoch, stepped_from, group)


def provenance_id(provenance: Provenance) -> bytes:
    """A 16-byte id of a provenance, for progress records (``PeerProgress.state``): two
    members whose states are exactly the post-step states of the same provenance report
    the same id."""
    h = hashlib.blake2b(digest_size=16, person=b"swarmavg.prov1")
    h.update(struct.pack("<q", provenance.epoch))
    h.update(struct.pack("<Q", len(provenance.stepped_from)) + provenance.stepped_from)
    h.update(provenance.group.encode())
    return h.digest()


__all__ = ["Provenance", "Role", "Verdict", "judge", "majority_digest", "provenance_id"]
