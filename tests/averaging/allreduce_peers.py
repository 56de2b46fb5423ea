"""In-process all-reduce peers for tests: one grpc.aio server + AllReduceService each."""

from __future__ import annotations

import asyncio
import os
import time
from collections.abc import Sequence
from dataclasses import dataclass

import grpc
import numpy as np

from swarmavg.averaging.allreduce.config import AllReduceConfig
from swarmavg.averaging.allreduce.faults import FaultPlan
from swarmavg.averaging.allreduce.runner import FiniteCheck, run_allreduce
from swarmavg.averaging.allreduce.service import AllReduceService
from swarmavg.averaging.group import GroupInfo, Member, Mode, schema_hash
from swarmavg.averaging.result import AveragingResult
from swarmavg.averaging.service import add_reduce_to_server
from swarmavg.dht import Authenticator, ChannelPool, Identity, RequestSigner
from tests.harness import GrpcServerPool

RUN_ID = "test-allreduce"
DATA_PLANE = False
"""Whether :func:`start_peers` serves the data plane by default (the ``allreduce_transport``
fixture of tests/averaging/conftest.py runs whole modules over both transports)."""
FAST = AllReduceConfig(min_stall=1.0, stall_factor=8.0, registration_wait=3.0, chunk_bytes=4096)


@dataclass
class LocalPeer:
    identity: Identity
    service: AllReduceService
    address: str
    data_port: int = 0

    @property
    def signer(self) -> RequestSigner:
        return RequestSigner(self.identity, RUN_ID, lambda: self.address)


async def start_peers(
    servers: GrpcServerPool,
    n: int,
    config: AllReduceConfig = FAST,
    *,
    data_plane: bool | None = None,
) -> list[LocalPeer]:
    """``n`` reducers on gRPC servers; with ``data_plane`` (default: :data:`DATA_PLANE`)
    each also serves the framed-TCP data plane, which its group membership advertises."""
    identities = [Identity.generate() for _ in range(n)]
    services = [AllReduceService(Authenticator(i, RUN_ID), config) for i in identities]

    def register(server: grpc.aio.Server, i: int) -> None:
        add_reduce_to_server(services[i], server)

    addresses = await servers.start(n, register)
    ports = [0] * n
    if DATA_PLANE if data_plane is None else data_plane:
        ports = [await s.start_data_plane("127.0.0.1") for s in services]
    return [LocalPeer(identities[i], services[i], addresses[i], ports[i]) for i in range(n)]


async def close_peers(peers: Sequence[LocalPeer]) -> None:
    await asyncio.gather(*(p.service.close() for p in peers))


def make_group(
    peers: Sequence[LocalPeer],
    tensors: Sequence[np.ndarray],
    modes: Sequence[Mode] | None = None,
    bandwidths: Sequence[float] | None = None,
    codec: str = "none",
) -> GroupInfo:
    modes = modes or [Mode.NODE] * len(peers)
    bandwidths = bandwidths or [1.0] * len(peers)
    members = tuple(
        Member(
            p.identity.peer_id,
            None if mode is Mode.CLIENT else p.address,
            mode,
            0.0 if mode is Mode.CLIENT else bw,
            data_port=0 if mode is Mode.CLIENT else p.data_port,
        )
        for p, mode, bw in zip(peers, modes, bandwidths, strict=True)
    )
    return GroupInfo(os.urandom(16), members, schema_hash(tensors), codec)


async def run_group(
    peers: Sequence[LocalPeer],
    group: GroupInfo,
    inputs: Sequence[Sequence[np.ndarray]],
    weights: Sequence[float],
    channels: ChannelPool,
    timeout: float = 20.0,
    faults: dict[int, FaultPlan] | None = None,
    skip: Sequence[int] = (),
    outs: Sequence[Sequence[np.ndarray] | None] | None = None,
    finite_checks: dict[int, FiniteCheck] | None = None,
) -> list[AveragingResult | BaseException | None]:
    """Run every member's side at once; ``skip`` members never start (None in results);
    ``outs[i]`` is member i's ``out`` (where its result goes); ``finite_checks[i]``
    where member i's tensors are checked (default: up front)."""
    deadline = time.monotonic() + timeout
    faults = faults or {}

    async def one(i: int) -> AveragingResult | None:
        if i in skip:
            return None
        return await run_allreduce(
            group,
            i,
            inputs[i],
            weights[i],
            deadline=deadline,
            service=peers[i].service,
            channels=channels,
            signer=peers[i].signer,
            fault_plan=faults.get(i),
            out=None if outs is None else outs[i],
            finite_check=(finite_checks or {}).get(i, FiniteCheck.UPFRONT),
        )

    return list(await asyncio.gather(*(one(i) for i in range(len(peers))), return_exceptions=True))


async def exact_round(peers: Sequence[LocalPeer], channels: ChannelPool, seed: int) -> None:
    """One round of ``peers`` (4 chunks of FAST's 4 KiB per part): every result whole, the
    exact mean, bit-identical across members."""
    rng = np.random.default_rng(seed)
    size = len(peers) * 4 * 1024
    inputs = [[rng.standard_normal(size).astype(np.float32)] for _ in peers]
    group = make_group(peers, inputs[0])
    results = await run_group(peers, group, inputs, [1.0] * len(peers), channels, timeout=30)
    mean = np.stack([x[0] for x in inputs]).mean(axis=0)
    whole = [r for r in results if isinstance(r, AveragingResult)]
    assert len(whole) == len(peers), results
    for result in whole:
        assert not result.partial, (result.dropped, result.failed_parts, result.unconfirmed_ends)
        np.testing.assert_allclose(result.tensors[0], mean, rtol=1e-5, atol=1e-6)
        assert result.tensors[0].tobytes() == whole[0].tensors[0].tobytes()
