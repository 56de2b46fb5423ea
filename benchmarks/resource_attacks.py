"""Memory and service under the resource attacks of issue 17; prints ONE JSON line.

Each attack runs against in-process reducers on real gRPC servers and the real data plane
(127.0.0.1), as in ``tests/averaging/test_resource_limits.py``, and reports what the
attacked peer holds (``tracemalloc``: Python and numpy allocations) and whether honest
members are still served. It uses only APIs that exist before issue 17 too, so the same
script measures the code before the change (run it with that checkout first on
``PYTHONPATH``) and after.

- ``silent_streams``: 64 streams that never send, on one HTTP/2 connection, while an honest
  round of 3 runs: parts that failed in the honest round.
- ``non_reader``: a 4th member sends every chunk (8 MiB parts) and never reads: MiB still
  held by the reducers once the round is over, and the round's seconds.
- ``frame_headers``: 64 data-plane connections from 127.0.0.2 each declare a 4 MiB frame
  and send all of it but its last byte: MiB allocated (traced) and RSS growth.
- ``slow_readers``: 8 joiners ask a donor for all of a 32 MiB state and never read; then
  an honest joiner loads: how its ``load_state`` ended, and its seconds.
- ``codec_flood``: 12 rounds whose codec is ``topk`` spelled 12 ways: codec instances and
  MiB of error-feedback residuals kept by one peer.

Usage: ``python benchmarks/resource_attacks.py`` (before: ``PYTHONPATH=<link tree of the
old checkout> python benchmarks/resource_attacks.py``; see docs/benchmarks.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import json
import os
import struct
import sys
import time
import tracemalloc
from pathlib import Path
from typing import Any

import grpc
import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # the tests' helpers

from swarmavg.averaging.allreduce import service as service_module
from swarmavg.averaging.allreduce.data_plane import MAGIC
from swarmavg.averaging.allreduce.load_balancing import part_sizes
from swarmavg.averaging.allreduce.partition import PartPlan, chunk_elements_for
from swarmavg.averaging.allreduce.reducer import weighted_mean
from swarmavg.averaging.allreduce.runner import _bytes_per_element
from swarmavg.averaging.group import Mode
from swarmavg.averaging.result import AveragingResult
from swarmavg.dht import ChannelPool
from tests.averaging.allreduce_peers import (
    FAST,
    close_peers,
    make_group,
    run_group,
    start_peers,
)
from tests.averaging.test_allreduce_hostile import CODEC, Hostile
from tests.harness import GrpcServerPool

MIB = 1 << 20
OWN = [("grpc.use_local_subchannel_pool", 1)]
REDUCE = "/swarmavg.v1.Averaging/Reduce"


def _call(channel: grpc.aio.Channel, timeout: float) -> grpc.aio.StreamStreamCall:
    from swarmavg.proto import averaging_pb2

    return channel.stream_stream(
        REDUCE,
        request_serializer=averaging_pb2.ReduceRequest.SerializeToString,
        response_deserializer=averaging_pb2.ReduceResponse.FromString,
    )(timeout=timeout)


def _rss_mib() -> float:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) / 1024
    return float("nan")


async def silent_streams() -> dict[str, Any]:
    servers, channels = GrpcServerPool(), ChannelPool()
    peers = await start_peers(servers, 3)
    attack = grpc.aio.insecure_channel(peers[0].address, options=OWN)
    calls = [_call(attack, 30.0) for _ in range(64)]
    try:
        await asyncio.sleep(0.5)  # the server takes the 64 streams
        rng = np.random.default_rng(3)
        inputs = [[rng.standard_normal(20_000).astype(np.float32)] for _ in peers]
        results = await run_group(peers, make_group(peers, inputs[0]), inputs, [1.0] * 3, channels)
        failed = sum(len(r.failed_parts) for r in results if isinstance(r, AveragingResult))
        return {"honest_failed_parts": failed, "honest_ok": failed == 0}
    finally:
        for c in calls:
            c.cancel()
        await attack.close()
        await close_peers(peers)
        await channels.close()
        await servers.close()


async def non_reader() -> dict[str, Any]:
    servers, channels = GrpcServerPool(), ChannelPool()
    config = dataclasses.replace(FAST, chunk_bytes=MIB)
    peers = await start_peers(servers, 4, config)
    calls: list[grpc.aio.StreamStreamCall] = []
    attack = [grpc.aio.insecure_channel(p.address, options=OWN) for p in peers[:3]]
    try:
        rng = np.random.default_rng(5)
        inputs = [[rng.standard_normal(3 * (2 << 20)).astype(np.float32)] for _ in peers]
        mean = weighted_mean([x[0] for x in inputs[:3]], [1.0] * 3)
        group = make_group(peers, inputs[0], [Mode.NODE] * 3 + [Mode.CLIENT])
        hostile = Hostile(group, peers[3].identity, mean)
        hostile.plan = PartPlan.build(
            part_sizes(group.members, mean.size),
            chunk_elements_for(_bytes_per_element(CODEC, np.dtype(np.float32)), MIB),
        )
        gc.collect()
        before = tracemalloc.get_traced_memory()[0]

        async def send(part: int) -> None:
            call = _call(attack[part], 60.0)
            calls.append(call)
            for message in hostile.valid(part):
                await call.write(message)

        senders = [asyncio.ensure_future(send(p)) for p in range(3)]
        started = time.monotonic()
        results = await run_group(peers, group, inputs, [1.0] * 4, channels, timeout=20, skip=[3])
        seconds = time.monotonic() - started
        for s in senders:
            s.cancel()
            with contextlib.suppress(asyncio.CancelledError, grpc.RpcError):
                await s
        del results
        await asyncio.sleep(1.0)  # let released handlers finish
        gc.collect()
        held = (tracemalloc.get_traced_memory()[0] - before) / MIB
        return {"held_after_round_mib": round(held, 1), "round_s": round(seconds, 2)}
    finally:
        for c in calls:
            c.cancel()
        for ch in attack:
            await ch.close()
        await close_peers(peers)
        await channels.close()
        await servers.close()


async def frame_headers() -> dict[str, Any]:
    servers = GrpcServerPool()
    peers = await start_peers(servers, 1, data_plane=True)
    writers: list[asyncio.StreamWriter] = []
    try:
        gc.collect()
        before, rss0 = tracemalloc.get_traced_memory()[0], _rss_mib()
        tracemalloc.reset_peak()
        body = 4 * MIB
        head = struct.pack("<IB", len(MAGIC), 0) + MAGIC + struct.pack("<IB", body, 1)
        filler = bytes(body - 1)
        for _ in range(64):
            _, writer = await asyncio.open_connection(
                "127.0.0.1", peers[0].data_port, local_addr=("127.0.0.2", 0)
            )
            writer.write(head + filler)
            writers.append(writer)
        # The reducer closes a connection whose first message is not complete within its
        # registration wait (3 s here), so the peak is taken within that window.
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(2):
                await asyncio.gather(*(w.drain() for w in writers), return_exceptions=True)
        peak = (tracemalloc.get_traced_memory()[1] - before) / MIB
        return {
            "connections": 64,
            "declared_mib": 64 * 4,
            "allocated_peak_mib": round(peak, 1),
            "rss_growth_mib": round(_rss_mib() - rss0, 1),
        }
    finally:
        for w in writers:
            w.close()
        await asyncio.gather(*(w.wait_closed() for w in writers), return_exceptions=True)
        await close_peers(peers)
        await servers.close()


async def slow_readers() -> dict[str, Any]:
    from swarmavg.averaging.state.config import StateSharingConfig
    from swarmavg.averaging.stubs import DOWNLOAD_STATE, download_state_method
    from swarmavg.proto import averaging_pb2
    from tests.averaging.averager_swarm import AveragerSwarm, fast_config

    config = fast_config(state=StateSharingConfig(chunk_size=MIB, message_timeout=1.0))
    swarm = AveragerSwarm()
    attack: list[grpc.aio.Channel] = []
    calls: list[Any] = []
    try:
        donor = await swarm.add(config)
        joiner = await swarm.add(config)
        tensors = [np.random.default_rng(1).standard_normal(8 << 20).astype(np.float32)]
        await donor.averager.publish_state(tensors, b"m")
        manifest = donor.averager.state_sharer.published
        assert manifest is not None
        for _ in range(8):
            channel = grpc.aio.insecure_channel(donor.address, options=OWN)
            attack.append(channel)
            request = averaging_pb2.StateRequest(
                root=manifest.root, chunk_hashes=manifest.chunk_hashes
            )
            joiner.node.signer.signed(request, donor.node.peer_id, DOWNLOAD_STATE)
            calls.append(download_state_method(channel)(request, timeout=60))
        await asyncio.sleep(1.0)  # the donor takes the 8 streams
        started = time.monotonic()
        try:
            await joiner.averager.load_state(timeout=30)
            outcome = "loaded"
        except Exception as e:
            outcome = type(e).__name__
        return {"readers": 8, "joiner": outcome, "joiner_s": round(time.monotonic() - started, 2)}
    finally:
        for c in calls:
            c.cancel()
        for ch in attack:
            await ch.close()
        await swarm.close()


async def codec_flood() -> dict[str, Any]:
    servers, channels = GrpcServerPool(), ChannelPool()
    peers = await start_peers(servers, 3)
    try:
        rng = np.random.default_rng(11)
        inputs = [[rng.standard_normal(1 << 18).astype(np.float32)] for _ in peers]
        spellings = [f"topk:fraction=0.{i}1" for i in range(1, 10)]
        spellings += ["topk:fraction=0.5", "topk:fraction=0.50", "topk:fraction=5e-1"]
        for spelling in spellings:
            group = make_group(peers, inputs[0], codec=spelling)
            await run_group(peers, group, inputs, [1.0] * 3, channels)
        codecs = peers[0].service._codecs  # before issue 17 there was no public count
        residual = sum(getattr(getattr(c, "feedback", None), "nbytes", 0) for c in codecs.values())
        return {
            "spellings": len(spellings),
            "codec_instances": len(codecs),
            "residual_mib": round(residual / MIB, 1),
        }
    finally:
        await close_peers(peers)
        await channels.close()
        await servers.close()


async def main(code: str) -> None:
    tracemalloc.start()
    out: dict[str, Any] = {
        "benchmark": "resource_attacks",
        "code": code,
        "silent_streams": await silent_streams(),
        "non_reader": await non_reader(),
        "frame_headers": await frame_headers(),
        "slow_readers": await slow_readers(),
        "codec_flood": await codec_flood(),
        "pid": os.getpid(),
    }
    print(json.dumps(out), flush=True)


if __name__ == "__main__":
    asyncio.run(main(str(Path(service_module.__file__).resolve().parents[2])))
