"""``sparseloco`` through the real all-reduce (in-process gRPC): the round's result is the
weighted mean of what the members sent (each member's input minus the residual its
codec kept), to half precision, on every member bit for bit."""

from __future__ import annotations

import re

import numpy as np

from swarmavg.averaging.result import AveragingResult
from swarmavg.compression import SparseLoCoCodec
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import close_peers, make_group, run_group, start_peers
from tests.harness import GrpcServerPool

_SLICE = re.compile(r"/flat\[(\d+):(\d+)\]$")


def _sent(codec: SparseLoCoCodec, x: np.ndarray) -> np.ndarray:
    """The member's input minus what its codec kept back (its first round: no residual before)."""
    assert codec.feedback is not None
    sent = x.astype(np.float32).copy()
    for key, part in codec.feedback.entries():
        match = _SLICE.search(key)
        if match:
            start, end = int(match[1]), int(match[2])
            residual = codec.feedback.peek((key, part))
            assert residual is not None
            sent[start:end] -= residual
    return sent


async def test_the_round_gives_the_mean_of_what_the_members_sent(
    grpc_servers: GrpcServerPool, channels: ChannelPool
) -> None:
    n = 4
    peers = await start_peers(grpc_servers, n)
    try:
        rng = np.random.default_rng(5)
        inputs = [[rng.standard_normal(20_000).astype(np.float32)] for _ in range(n)]
        weights = [1.0, 2.0, 0.5, 1.0]
        group = make_group(peers, inputs[0], codec="sparseloco:fraction=0.02,block=1024")
        results = await run_group(peers, group, inputs, weights, channels)
        codecs = [p.service.codec("sparseloco:fraction=0.02,block=1024") for p in peers]
        assert all(isinstance(c, SparseLoCoCodec) for c in codecs)
        sent = [_sent(c, x[0]) for c, x in zip(codecs, inputs, strict=True)]  # type: ignore[arg-type]
        # Each member sent about 2% of its input, and kept the rest.
        for s, x in zip(sent, inputs, strict=True):
            assert np.count_nonzero(s) <= 0.03 * x[0].size
            assert np.abs(s).max() <= np.abs(x[0]).max() * 1.01
        w = np.array(weights)
        expected = sum(wi * s.astype(np.float64) for wi, s in zip(w, sent, strict=True)) / w.sum()
        got = []
        for r in results:
            assert isinstance(r, AveragingResult), r
            assert not r.partial
            got.append(np.asarray(r.tensors[0]))
        scale = np.abs(expected).max()
        np.testing.assert_allclose(got[0], expected, rtol=2**-10, atol=scale * 2**-20)
        for g in got[1:]:
            assert g.tobytes() == got[0].tobytes()
    finally:
        await close_peers(peers)
