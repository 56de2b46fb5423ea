"""A reducer forges its part (high).

Only a part's reducer runs the aggregation rule; members checked a reply's index, size,
codec, sender counts and finiteness, so a reducer could return any finite values for its
part under every rule: with ``centered-clip``, a quarter of every honest result was 1e6,
``partial=False``. Now each member compares every part's averages with its own values of
that part against the other parts (averaging/allreduce/part_check.py) and refuses a part
that is far off in both measures: it keeps local values, the result is partial and the
part is in ``distrusted`` and ``failed_parts``. The check runs under the robust rules (the
choice of a run that admits strangers); under the mean any member bends every part by what
it sends, and the check is off.

The attacker is a real member of the group: it sends its chunks honestly and reduces its
part with the real reducer over real gRPC streams, and only the averages it returns are
replaced on their way to the codec (``ReducerRound._encode_result``, the one place every
reply of every rule is encoded). The control round is the same group without the forgery.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable

import numpy as np
import pytest

from swarmavg.averaging.aggregation import canonical_aggregation
from swarmavg.averaging.allreduce.load_balancing import part_sizes
from swarmavg.averaging.allreduce.round import ReducerRound
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import close_peers, make_group, run_group, start_peers
from tests.harness import GrpcServerPool

pytestmark = pytest.mark.timeout(60)

MEMBERS = 4
ATTACKER = MEMBERS - 1
SIZE = 24_000

Forgery = Callable[[np.ndarray], np.ndarray]
FORGERIES: dict[str, Forgery] = {
    # far out of scale: what the review saw
    "1e6": lambda average: np.full_like(average, 1e6),
    # in scale: the honest average turned against its direction, 4 x (gradient ascent at
    # four times the step), values no form check can tell from an honest average
    "reversed-4x": lambda average: -4.0 * average,
}


@pytest.fixture
def forge(monkeypatch: pytest.MonkeyPatch) -> dict[str, Forgery]:
    """While the dict holds a forgery under "now", the attacker's reducer returns it."""
    active: dict[str, Forgery] = {}
    encode = ReducerRound._encode_result

    def forged_encode(
        self: ReducerRound,
        chunk: int,
        values: np.ndarray,
        contributors: int,
        adjusted: int,
        finite: bool,
    ) -> object:
        forgery = active.get("now")
        if forgery is not None and self.my_index == ATTACKER:
            values = forgery(values).astype(values.dtype)
        return encode(self, chunk, values, contributors, adjusted, finite)

    monkeypatch.setattr(ReducerRound, "_encode_result", forged_encode)
    return active


def _inputs(seed: int) -> list[list[np.ndarray]]:
    """Gradients as members have them: a shared signal plus each member's own noise, in
    two tensors whose scales differ 100x."""
    rng = np.random.default_rng(seed)
    signal = rng.standard_normal(SIZE)
    scales = np.where(np.arange(SIZE) < SIZE // 3, 100.0, 1.0)
    return [
        [((signal + 0.5 * rng.standard_normal(SIZE)) * scales).astype(np.float32)]
        for _ in range(MEMBERS)
    ]


@pytest.mark.parametrize("rule", ["centered-clip", "trimmed-mean"])
@pytest.mark.parametrize("forgery", list(FORGERIES))
@pytest.mark.parametrize("in_place", [False, True], ids=["out-of-place", "in-place"])
async def test_members_refuse_a_forged_part(
    grpc_servers: GrpcServerPool,
    forge: dict[str, Forgery],
    rule: str,
    forgery: str,
    in_place: bool,
) -> None:
    peers = await start_peers(grpc_servers, MEMBERS, data_plane=False)
    channels = ChannelPool()
    try:
        inputs = _inputs(seed=3)
        group = dataclasses.replace(
            make_group(peers, inputs[0]), aggregation=canonical_aggregation(rule)
        )
        sizes = part_sizes(group.members, SIZE)
        forged = slice(sum(sizes[:ATTACKER]), SIZE)  # the attacker's part: the last

        # Control: the same members, nobody forging: nothing is refused.
        control = await run_group(peers, group, _inputs(seed=3), [1.0] * MEMBERS, channels)
        for result in control:
            assert isinstance(result, AveragingResult), result
            assert not result.partial, (result.distrusted, result.dropped)
            assert result.distrusted == {}
        honest_average = control[0].tensors[0][forged].copy()  # type: ignore[union-attr]

        forge["now"] = FORGERIES[forgery]
        originals = [[t.copy() for t in ts] for ts in inputs]
        outs = [inputs[i] if in_place else None for i in range(MEMBERS)]
        attacked_group = dataclasses.replace(group, group_id=b"forged-" + group.group_id[:8])
        results = await run_group(
            peers, attacked_group, inputs, [1.0] * MEMBERS, channels, outs=outs
        )
        for i, result in enumerate(results[:ATTACKER]):
            assert isinstance(result, AveragingResult), result
            assert result.partial
            assert result.failed_parts == (ATTACKER,)
            assert ATTACKER in result.distrusted
            assert "forged averages" in result.distrusted[ATTACKER]
            out = result.tensors[0]
            # the forged part kept this member's own values, bit for bit
            assert out[forged].tobytes() == originals[i][0][forged].tobytes()
            assert not np.allclose(out[forged], FORGERIES[forgery](honest_average))
            # every other part is the honest average, as in the control round (the mean
            # adds copies in arrival order: equal up to rounding)
            expected = control[i].tensors[0]  # type: ignore[union-attr]
            np.testing.assert_allclose(
                out[: forged.start], expected[: forged.start], rtol=1e-5, atol=1e-4
            )
    finally:
        await channels.close()
        await close_peers(peers)


@pytest.mark.parametrize("codec", ["topk:fraction=0.05", "uint8-blockwise"])
async def test_honest_rounds_of_lossy_codecs_refuse_nothing(
    grpc_servers: GrpcServerPool, codec: str
) -> None:
    """Lossy codecs move every part's averages away from our values by their error (top-k
    keeps 5% of each chunk and carries the rest over in its error feedback): alike for every
    honest part, so nothing is refused, round after round."""
    peers = await start_peers(grpc_servers, MEMBERS, data_plane=False)
    channels = ChannelPool()
    try:
        for seed in range(8):
            inputs = _inputs(seed)
            group = dataclasses.replace(
                make_group(peers, inputs[0], codec=codec),
                aggregation=canonical_aggregation("centered-clip"),
            )
            results = await run_group(peers, group, inputs, [1.0] * MEMBERS, channels)
            for result in results:
                assert isinstance(result, AveragingResult), result
                assert result.distrusted == {}, result.distrusted
                assert not result.partial
    finally:
        await channels.close()
        await close_peers(peers)


async def test_under_the_mean_the_check_is_off(
    grpc_servers: GrpcServerPool, forge: dict[str, Forgery]
) -> None:
    """Under the mean a sender bends every part by what it sends; the check (and its cost)
    is for the robust rules: a forged part is taken, as any member's values are."""
    peers = await start_peers(grpc_servers, MEMBERS, data_plane=False)
    channels = ChannelPool()
    try:
        forge["now"] = FORGERIES["1e6"]
        group = make_group(peers, _inputs(seed=3)[0])
        results = await run_group(peers, group, _inputs(seed=3), [1.0] * MEMBERS, channels)
        for result in results[:ATTACKER]:
            assert isinstance(result, AveragingResult), result
            assert result.distrusted == {}
            assert not result.partial
            assert float(np.max(result.tensors[0])) == 1e6
    finally:
        await channels.close()
        await close_peers(peers)
