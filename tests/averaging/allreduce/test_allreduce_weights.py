"""A member's weight is bounded relative to its group.

Before the bound, weight 1e300 overflowed the float32 accumulator to NaN, the reducer's
emitter died on encoding it and the part stalled to the deadline; weight 1e6 x the median
simply dictated the mean. Now a weight counts as at most ``weight_bound`` (10) times the
median weight of the part's senders, and the accumulator only ever adds factors in [0, 1].
"""

from __future__ import annotations

import numpy as np
import pytest

from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import close_peers, make_group, run_group, start_peers
from tests.harness import GrpcServerPool

pytestmark = [pytest.mark.timeout(60), pytest.mark.usefixtures("allreduce_transport")]

HONEST = 3
BOUND = 10.0  # AllReduceConfig.weight_bound's default


@pytest.mark.parametrize("claimed", [1e300, 1e6], ids=["1e300", "1e6-x-median"])
async def test_an_absurd_weight_is_bounded(
    grpc_servers: GrpcServerPool, channels: ChannelPool, claimed: float
) -> None:
    peers = await start_peers(grpc_servers, HONEST + 1)
    try:
        rng = np.random.default_rng(5)
        honest = [[rng.standard_normal(3000).astype(np.float32)] for _ in range(HONEST)]
        attacker = [np.full(3000, 100.0, np.float32)]
        inputs = [*honest, attacker]
        weights = [1.0] * HONEST + [claimed]
        group = make_group(peers, inputs[0])
        results = await run_group(peers, group, inputs, weights, channels, timeout=10.0)
        honest_mean = np.mean([x[0] for x in honest], axis=0, dtype=np.float64)
        # the attacker's share of the mean is at most BOUND / (BOUND + HONEST)
        share = BOUND / (BOUND + HONEST)
        expected = (1 - share) * honest_mean + share * 100.0
        for result in results:
            assert isinstance(result, AveragingResult), result
            assert not result.partial, result.dropped
            out = result.tensors[0]
            assert np.isfinite(out).all()
            np.testing.assert_allclose(out, expected, rtol=1e-4, atol=1e-4)
            # every part's reducer clipped the one oversized weight, and said so
            assert result.weights_clipped == group.size
        for other in results[1:]:
            assert other.tensors[0].tobytes() == results[0].tensors[0].tobytes()  # type: ignore[union-attr]
    finally:
        await close_peers(peers)
