"""What the wrappers do with a partial round: apply it only when at least
``min_averaged_fraction`` of it came back averaged, as the member itself observed; else step
with local values, as for a failed round (averaging/training/swarm.py, MIN_AVERAGED_FRACTION).
"""

from __future__ import annotations

import dataclasses
import warnings

import pytest

torch = pytest.importorskip("torch")

from swarmavg.averaging.optim import SwarmRoundWarning  # noqa: E402
from swarmavg.averaging.training.swarm import MIN_AVERAGED_FRACTION  # noqa: E402
from tests.training.memswarm import MemorySwarm, Result  # noqa: E402
from tests.training.test_shared_state import make_peer, train_all  # noqa: E402

pytestmark = pytest.mark.timeout(120)


def _same(a: torch.nn.Module, b: torch.nn.Module) -> bool:
    return all(torch.equal(p, q) for p, q in zip(a.parameters(), b.parameters(), strict=True))


@pytest.mark.parametrize("local_fraction", [0.0, 0.2, 0.8, 1.0])
def test_a_partial_round_is_applied_only_when_mostly_averaged(local_fraction: float) -> None:
    swarm = MemorySwarm()
    peers = [make_peer(swarm, n) for n in "abc"]

    def partial_for_c(caller: str, result: Result) -> Result:
        if caller != "c" or result.group_id != b"run.grads.1".hex():
            return result
        # c's daemon saw part of the round keep local values (a reducer failed or answered
        # inconsistently); the tensors are the group's average, so applying them makes c
        # equal to the others, stepping locally does not.
        return dataclasses.replace(result, partial=True, local_fraction=local_fraction)

    swarm.forge = partial_for_c
    applied = 1.0 - local_fraction >= MIN_AVERAGED_FRACTION
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", SwarmRoundWarning)  # c's local step, if it takes one
        train_all(peers, 2)
    (a_model, _), _, (c_model, c_opt) = peers
    stats = c_opt.link.stats
    assert stats.partial == 1
    assert stats.partial_skipped == (0 if applied else 1)
    assert stats.failed == 0
    assert _same(a_model, c_model) is applied
    if not applied:
        assert "min_averaged_fraction" in stats.last_error
    # Either way the next round brings c back to the group's state.
    train_all(peers, 3)
    assert _same(a_model, c_model)
