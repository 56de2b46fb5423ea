"""Each fixed attack row's scenario and its control, the honest peers' outcome; prints ONE
JSON line.

Real daemons and averagers on 127.0.0.1 (real DHT nodes, real gRPC), staged as the attack
tests in this folder stage them, with their attacker builders. For each row: ``attack``
and ``control``, each the honest side's outcome (a result, an error class, partial, a
refused count) and, where a duration means something, its ``seconds``. The rows where it
does not (#2, a crash; #17, a local endpoint; #12, a routing table) report outcomes only.

Each row imports what it needs when it runs, so that the same script runs on older code
(its checkout first on ``PYTHONPATH``): a row whose scenario cannot be staged there
reports ``{"skipped": "<exception>"}`` instead of failing the report.

Usage: ``python -m tests.attacks.attack_report [--rows 1,2,5,6,9,10,12,15,17]`` from the
repository root. It lives beside the attack tests because it re-runs their scenarios
(their builders are test code, which benchmarks/ does not import).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import os
import tempfile
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from pathlib import Path
from typing import Any

import numpy as np

Row = dict[str, Any]


def error_name(exc: BaseException) -> str:
    return type(exc).__name__


async def timed(work: Awaitable[Any]) -> tuple[Any, float]:
    """``work``'s result (or the exception it raised) and its seconds."""
    started = time.monotonic()
    try:
        result: Any = await work
    except Exception as exc:  # the report records what the honest side got
        result = exc
    return result, round(time.monotonic() - started, 2)


@contextlib.asynccontextmanager
async def relayed_calls(target: str) -> AsyncIterator[tuple[Any, list[Any]]]:
    """A channel to ``target`` from 127.0.1.1 (another /24 than the honest peers'), through
    a TCP relay, and a list for its calls: cancelled, then the channel closed, on exit."""
    import grpc

    from tests.attacks.test_reduce_slots import ATTACKER, OWN_CONNECTION, SourceRelay

    relay = SourceRelay(target, ATTACKER)
    calls: list[Any] = []
    channel: grpc.aio.Channel | None = None
    try:
        channel = grpc.aio.insecure_channel(await relay.start(), options=[OWN_CONNECTION])
        yield channel, calls
    finally:
        for call in calls:
            call.cancel()
        if channel is not None:
            await channel.close()
        await relay.close()


# ---------------------------------------------------------------- #1 state hijack


async def state_hijack() -> Row:
    from tests.attacks.test_state_version_hijack import (
        CONFIG,
        HUGE,
        forged_state,
        honest_state,
        same,
    )
    from tests.averaging.averager_swarm import AveragerSwarm

    def loaded(got: Any, seconds: float) -> dict[str, Any]:
        if isinstance(got, BaseException):
            return {"error": error_name(got), "seconds": seconds}
        metadata, tensors = got
        state = "honest" if same(tensors, honest_state()) else "other"
        state = "forged" if same(tensors, forged_state()) else state
        return {"loaded": state, "metadata": metadata.decode(), "seconds": seconds}

    swarm = AveragerSwarm()
    try:
        honest = [await swarm.add(CONFIG) for _ in range(2)]
        attacker = await swarm.add(CONFIG)
        control_joiner, joiner = await swarm.add(CONFIG), await swarm.add(CONFIG)
        for donor in honest:
            await donor.averager.publish_state(honest_state(), b"epoch=7")
        control = loaded(*await timed(control_joiner.averager.load_state(timeout=30)))
        await attacker.averager.publish_state(forged_state(), b"epoch=999999", version=HUGE)
        attack = loaded(*await timed(joiner.averager.load_state(timeout=30)))
        return {"attack": attack, "control": control}
    finally:
        await swarm.close()


# ---------------------------------------------------------------- #2 metadata crash


async def metadata_crash() -> Row:
    from swarmavg.averaging.errors import AveragingError
    from swarmavg.averaging.training.swarm import SwarmLink
    from swarmavg.peer import Peer, PeerConfig, connect

    def wrapper_load(endpoint: str) -> str:
        """What a training process gets from ``SwarmLink.load``."""
        import torch

        try:
            with connect(endpoint) as client:
                link = SwarmLink(client, "attack", codec=None, timeout=10.0, min_group_size=1,
                                 state_timeout=30.0)  # fmt: skip
                got = link.load("collaborative", like=[torch.zeros(4)])
        except BaseException as exc:  # a crash of the training process
            return f"raised {error_name(exc)}"
        return "returned: no usable state" if got is None else "returned a state"

    async def load(trainer: Any, endpoint: str) -> dict[str, Any]:
        try:
            metadata, _ = await trainer.load_state(timeout=30)
            client: Any = f"loaded {metadata}"
            caught = None
        except Exception as exc:
            client = error_name(exc)
            caught = isinstance(exc, AveragingError)
        wrapper = await asyncio.to_thread(wrapper_load, endpoint)
        return {"client": client, "an_averaging_error": caught, "swarm_link_load": wrapper}

    tensors = [np.arange(4, dtype=np.float32)]
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa-") as d:

        def config(name: str, join: str | None = None) -> Any:
            return PeerConfig(listen="127.0.0.1:0", control=f"{d}/{name}.sock",
                              run_id="attack", join=[join] if join else [])  # fmt: skip

        async with Peer(config("donor")) as donor, donor.client() as publisher:
            joiner_config = config("joiner", join=donor.address)
            async with Peer(joiner_config) as _joiner, _joiner.client() as trainer:
                await publisher.publish_state(tensors, {"epoch": 3})
                control = await load(trainer, joiner_config.control)
                await donor.averager.publish_state(tensors, b"\xc1")  # msgpack never-used byte
                attack = await load(trainer, joiner_config.control)
                await publisher.publish_state(tensors, {"epoch": 4})
                after = await load(trainer, joiner_config.control)
    return {"attack": attack, "control": control, "next_honest_state": after}


# ---------------------------------------------------------------- #5 replay floor


async def replay_floor() -> Row:
    import grpc

    from swarmavg.dht import DHTConfig, DHTNode, Identity
    from swarmavg.dht.protocol import DHTRPCError
    from tests.attacks.test_replay_floor import CACHE, OK, RUN, flood, raw_ping

    async def honest_side(honest: Any, target: Any, channel: Any) -> dict[str, Any]:
        """Five pings of the established peer and five newcomers': how many refused."""
        refused = 0
        started = time.monotonic()
        for _ in range(5):
            try:
                await honest.protocol.call_ping(target.address, expected_id=target.peer_id)
            except DHTRPCError:
                refused += 1
            refused += await raw_ping(channel, Identity.generate(), target.peer_id) != OK
        return {"refused": refused, "of": 10, "seconds": round(time.monotonic() - started, 2)}

    target = await DHTNode.create(DHTConfig(run_id=RUN, auth_max_nonces=CACHE))
    honest = await DHTNode.create(DHTConfig(run_id=RUN, initial_peers=[target.address]))
    channel = grpc.aio.insecure_channel(target.address)
    try:
        control = await honest_side(honest, target, channel)
        await raw_ping(channel, Identity.generate(), target.peer_id, at=time.time() + 119)
        one = Identity.generate()
        started = time.monotonic()
        await flood(channel, [one] * (CACHE + 200), target.peer_id)
        flood_s = round(time.monotonic() - started, 2)
        attack = await honest_side(honest, target, channel)
        attack["flood"] = {"messages": CACHE + 200, "cache": CACHE, "seconds": flood_s}
        return {"attack": attack, "control": control}
    finally:
        await channel.close()
        await honest.shutdown()
        await target.shutdown()


# ---------------------------------------------------------------- #6 handler pool


async def handler_pool() -> Row:
    from swarmavg.dht import DHTConfig, DHTNode
    from tests.attacks.test_handler_pool import HANDLERS, Target, server_limits, settle
    from tests.attacks.test_reduce_slots import reduce_call
    from tests.averaging.allreduce_peers import RUN_ID

    async def ping(pinger: Any, target: Any) -> dict[str, Any]:
        got, seconds = await timed(
            pinger.protocol.call_ping(target.address, expected_id=target.node.identity.peer_id)
        )
        outcome = "served" if not isinstance(got, BaseException) else error_name(got)
        if isinstance(got, BaseException) and getattr(got, "reason", None):
            outcome = f"{outcome}: {str(got.reason)[:60]}"
        return {"ping": outcome, "seconds": seconds}

    limits = server_limits(
        max_concurrent_rpcs=HANDLERS, max_rpcs_per_range=16, limit_local_ranges=True
    )
    target = Target(limits)
    await target.start()
    pinger = await DHTNode.create(DHTConfig(run_id=RUN_ID))
    try:
        control = await ping(pinger, target)
        async with relayed_calls(target.address) as (channel, calls):
            calls += [reduce_call(channel, 90.0) for _ in range(HANDLERS)]
            ended = await settle(target.service, calls)
            attack = await ping(pinger, target)
        attack["attacker_streams"] = HANDLERS
        attack["attacker_held"] = HANDLERS - len(ended)
        return {"attack": attack, "control": control}
    finally:
        await pinger.shutdown()
        await target.close()


# ---------------------------------------------------------------- #9 rate limit identity


async def rate_limit_identity() -> Row:
    from swarmavg.dht.auth import RequestSigner
    from swarmavg.dht.ratelimit import RateLimiter, RateLimits
    from tests.attacks.test_rate_limit_identity import BURST, FLOOD, Caller
    from tests.averaging.averager_swarm import RUN_ID, averager_swarm, fast_config

    async def victim_side(caller: Any, victim: Any, identity: Any) -> dict[str, Any]:
        started = time.monotonic()
        join = await caller.call(caller.join_request(victim, identity))
        state = await caller.call(caller.state_request(victim, identity))
        return {"join": join.name, "download_state": state.name,
                "seconds": round(time.monotonic() - started, 2)}  # fmt: skip

    async with averager_swarm(2, fast_config()) as swarm:
        leader, victim_peer = swarm.peers
        leader.averager._servicer.rate_limiter = RateLimiter(
            RateLimits(per_source_rate=0.01, per_source_burst=BURST)
        )
        identity = victim_peer.node.identity
        victim = RequestSigner(identity, RUN_ID, lambda: victim_peer.address)
        caller = Caller(leader)
        try:
            # the control spends one join of the victim's budget: so does the attack's call
            control = await victim_side(caller, victim, identity)
            codes = []
            for i in range(FLOOD):
                forged = (
                    caller.join_request(None, identity)
                    if i % 2
                    else caller.state_request(None, identity)
                )
                codes.append((await caller.call(forged)).name)
            attack = await victim_side(caller, victim, identity)
            attack["forged"] = {c: codes.count(c) for c in sorted(set(codes))}
        finally:
            await caller.close()
    return {"attack": attack, "control": control, "burst": BURST}


# ---------------------------------------------------------------- #10 reduce slots


async def reduce_slots() -> Row:
    import grpc

    from swarmavg.averaging.allreduce.runner import run_allreduce
    from swarmavg.averaging.result import AveragingResult
    from swarmavg.dht import ChannelPool, Identity
    from tests.attacks.test_reduce_slots import (
        HONEST,
        STREAMS,
        Watched,
        allreduce_config,
        reduce_call,
        signed_first,
    )
    from tests.averaging.allreduce_peers import close_peers, make_group, start_peers
    from tests.harness import GrpcServerPool

    async def honest_round(peers: Any, watched: Any, channels: Any, seed: int) -> dict[str, Any]:
        """The test's round (part 0's reducer starts once the others' streams wait for
        it), reported instead of asserted."""
        rng = np.random.default_rng(seed)
        inputs = [[rng.standard_normal(20_000).astype(np.float32)] for _ in peers]
        group = make_group(peers, inputs[0])
        deadline = time.monotonic() + 30.0

        async def member(i: int) -> Any:
            return await run_allreduce(group, i, inputs[i], 1.0, deadline=deadline,
                                       service=peers[i].service, channels=channels,
                                       signer=peers[i].signer)  # fmt: skip

        expected = {p.identity.peer_id for p in peers[1:]}
        watched.verified -= expected
        started = time.monotonic()
        senders = [asyncio.create_task(member(i)) for i in range(1, len(peers))]
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(20.0):
                while not expected <= watched.verified:
                    watched.changed.clear()
                    await watched.changed.wait()
        results = await asyncio.gather(member(0), *senders, return_exceptions=True)
        ok = [r for r in results if isinstance(r, AveragingResult)]
        return {
            "results": len(ok),
            "partial": sum(r.partial for r in ok),
            "failed_parts": sum(len(r.failed_parts) for r in ok),
            "errors": sorted({error_name(r) for r in results if isinstance(r, BaseException)}),
            "seconds": round(time.monotonic() - started, 2),
        }

    pool = GrpcServerPool()
    config = allreduce_config(registration_wait=15.0, limit_local_ranges=True)
    peers = await start_peers(pool, HONEST, config, data_plane=False)
    target = peers[0]
    watched = Watched(target.service.authenticator)
    target.service.authenticator = watched
    channels = ChannelPool()
    try:
        control = await honest_round(peers, watched, channels, seed=1)
        async with relayed_calls(target.address) as (channel, calls):
            ids = [Identity.generate() for _ in range(STREAMS)]
            for identity in ids:
                call = reduce_call(channel, 60.0)
                calls.append(call)
                first = signed_first(identity, target.identity.peer_id, os.urandom(16))
                with contextlib.suppress(grpc.RpcError):
                    await call.write(first)
            # every attack stream verified (then waiting or refused) or ended
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(30.0):
                    while not all(c.done() or i.peer_id in watched.verified
                                  for c, i in zip(calls, ids, strict=True)):  # fmt: skip
                        watched.changed.clear()
                        with contextlib.suppress(TimeoutError):
                            await asyncio.wait_for(watched.changed.wait(), 0.5)
            attack = await honest_round(peers, watched, channels, seed=2)
            attack["attacker_held"] = sum(not c.done() for c in calls)
        attack["attacker_streams"] = STREAMS
        return {"attack": attack, "control": control}
    finally:
        await channels.close()
        await close_peers(peers)
        await pool.close()


# ---------------------------------------------------------------- #12 eclipse names


async def eclipse_names() -> Row:
    from swarmavg.dht import Identity
    from tests.attacks.test_eclipse_names import (
        PER_RANGE,
        SYBILS,
        claim,
        most_per_bucket,
        target_node,
    )

    async def sybils(addresses: Callable[[int], str]) -> dict[str, Any]:
        target, channel = await target_node()
        try:
            ids = [Identity.generate() for _ in range(SYBILS)]
            for i, sybil in enumerate(ids):
                await claim(channel, sybil, target.peer_id, addresses(i))
            held = most_per_bucket(target.routing, (s.peer_id for s in ids))
            return {"sybils": SYBILS, "most_in_one_bucket": held}
        finally:
            await channel.close()
            await target.shutdown()

    return {
        "attack": await sybils(lambda i: f"sybil{i}.invalid:31337"),
        "attack_other_ranges": await sybils(lambda i: f"127.{60 + i}.0.1:31337"),
        "control": await sybils(lambda i: f"127.0.0.1:{40000 + i}"),
        "per_range_limit": PER_RANGE,
    }


# ---------------------------------------------------------------- #15 state upload slots


async def state_upload_slots() -> Row:
    from swarmavg.proto import averaging_pb2
    from tests.attacks.upload_scenarios import CONFIG, outsider, slow_readers
    from tests.averaging.averager_swarm import AveragerSwarm

    def loaded(got: Any, seconds: float, tensors: Any) -> dict[str, Any]:
        if isinstance(got, BaseException):
            return {"error": error_name(got), "seconds": seconds}
        return {"loaded": got[1][0].tobytes() == tensors[0].tobytes(), "seconds": seconds}

    swarm = AveragerSwarm()
    try:
        donor = await swarm.add(CONFIG)
        control_joiner, joiner = await swarm.add(CONFIG), await swarm.add(CONFIG)
        tensors = [np.random.default_rng(1).standard_normal(8 << 20).astype(np.float32)]
        await donor.averager.publish_state(tensors, b"step=7")  # 32 MiB
        control = loaded(*await timed(control_joiner.averager.load_state(timeout=60)), tensors)
        attacker = outsider()
        async with slow_readers(donor, attacker, 8) as (_calls, firsts):
            codes = [averaging_pb2.StateCode.Name(first.code) for first in firsts]
            attack = loaded(*await timed(joiner.averager.load_state(timeout=60)), tensors)
        attack["attacker_streams"] = {c: codes.count(c) for c in sorted(set(codes))}
        return {"attack": attack, "control": control}
    finally:
        await swarm.close()


# ---------------------------------------------------------------- #17 local endpoint


async def local_endpoint() -> Row:
    from swarmavg.dht import Identity
    from swarmavg.peer import Peer, PeerConfig, connect_async
    from tests.attacks.local_scenarios import impostor_on, tcp_daemon

    async def client_call(endpoint: str) -> str:
        try:
            async with await connect_async(endpoint, connect_timeout=10) as client:
                await client.average([np.ones(8, np.float32)], key="k", min_group_size=1,
                                     timeout=30)  # fmt: skip
        except Exception as exc:
            return error_name(exc)
        return "served"

    outcome: Row = {}
    with tempfile.TemporaryDirectory(dir="/tmp", prefix="sa40-") as d:
        runtime = Path(d) / "runtime"
        runtime.mkdir(mode=0o700)
        old_runtime = os.environ.get("XDG_RUNTIME_DIR")
        os.environ["XDG_RUNTIME_DIR"] = str(runtime)  # the daemon's token folder
        try:
            async with tcp_daemon(Path(d) / "daemon.log") as (daemon, port):
                endpoint = f"127.0.0.1:{port}"
                control = {"client": await client_call(endpoint)}
                daemon.kill()
                await daemon.wait()
                async with impostor_on(endpoint) as impostor:
                    attack: Row = {"client": await client_call(endpoint)}
                attack["impostor_got_calls"] = len(impostor.calls)
                # the client sends its token as call metadata under a key naming it
                attack["impostor_got_token"] = any(
                    "token" in key.lower() for _, metadata in impostor.calls for key, _ in metadata
                )
            outcome["control_endpoint"] = {"attack": attack, "control": control}

            # the key file: a private one loads; one that others may read
            path = Path(d) / "identity.key"
            identity = Identity.load_or_create(path)
            config = PeerConfig(listen="127.0.0.1:0", identity=str(path), run_id="t40k")
            async with Peer(config) as peer:
                key_control = peer.peer_id == identity.peer_id_hex
            os.chmod(path, 0o644)
            try:
                async with Peer(config):
                    key_attack = "loaded"
            except Exception as exc:
                key_attack = error_name(exc)
            outcome["key_file_0644"] = {
                "attack": key_attack,
                "control": "loaded" if key_control else "other id",
            }
        finally:
            if old_runtime is None:
                os.environ.pop("XDG_RUNTIME_DIR", None)
            else:
                os.environ["XDG_RUNTIME_DIR"] = old_runtime
    return outcome


ROWS: dict[int, Callable[[], Awaitable[Row]]] = {
    1: state_hijack,
    2: metadata_crash,
    5: replay_floor,
    6: handler_pool,
    9: rate_limit_identity,
    10: reduce_slots,
    12: eclipse_names,
    15: state_upload_slots,
    17: local_endpoint,
}


async def main(rows: list[int]) -> dict[str, Any]:
    report: dict[str, Any] = {"benchmark": "attack_rows"}
    for row in rows:
        try:
            report[f"#{row}"] = await ROWS[row]()
        except Exception as exc:  # a scenario the code under test cannot stage
            report[f"#{row}"] = {"skipped": f"{error_name(exc)}: {str(exc)[:160]}"}
    return report


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default=",".join(str(r) for r in ROWS))
    args = parser.parse_args()
    chosen = [int(r) for r in args.rows.split(",") if r]
    print(json.dumps(asyncio.run(main(chosen))), flush=True)
