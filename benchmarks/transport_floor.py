"""Transport floor of a butterfly all-reduce: gRPC streams vs framed TCP, no averaging.

N processes (one per peer, uvloop) each stream ``--mb / N`` MB in 1 MiB messages to every
other peer, which echoes every message back: the byte pattern of a butterfly round
(each member sends its chunks of part j to member j and gets as many bytes back), with
no encoding, reduction or checks. ``grpc`` uses grpc.aio bidirectional streams with
identity serializers (what ``Reduce`` costs before our code runs); ``tcp`` uses
``asyncio.BufferedProtocol`` sockets that receive into preallocated buffers (what the
data plane's framing adds on top of the kernel). Prints one JSON line: median seconds
per round (slowest peer) and CPU seconds of all peers per round.

    python -m benchmarks.transport_floor --peers 2,4,8
"""

from __future__ import annotations

import argparse
import asyncio
import json
import multiprocessing as mp
import os
import resource
import statistics
import time
from multiprocessing.queues import Queue
from typing import Any

MESSAGE = 1 << 20
ROUNDS = 5


def _cpu() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _identity(x: bytes) -> bytes:
    return x


class _Echo(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.buffer = bytearray(MESSAGE)
        self.filled = 0
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buffer)[self.filled :]

    def buffer_updated(self, nbytes: int) -> None:
        self.filled += nbytes
        if self.filled == MESSAGE:
            self.transport.write(bytes(self.buffer))
            self.filled = 0


class _Sink(asyncio.BufferedProtocol):
    def __init__(self) -> None:
        self.buffer = bytearray(MESSAGE)
        self.received = 0
        self.expected = 0
        self.done: asyncio.Future[None] | None = None
        self.writable: asyncio.Future[None] | None = None
        self.transport: Any = None

    def connection_made(self, transport: Any) -> None:
        self.transport = transport

    def get_buffer(self, sizehint: int) -> memoryview:
        return memoryview(self.buffer)[self.received % MESSAGE :]

    def buffer_updated(self, nbytes: int) -> None:
        self.received += nbytes
        if self.received == self.expected and self.done is not None:
            self.done.set_result(None)

    def pause_writing(self) -> None:
        self.writable = asyncio.get_running_loop().create_future()

    def resume_writing(self) -> None:
        if self.writable is not None:
            self.writable.set_result(None)
            self.writable = None


async def _worker(rank: int, transport: str, mb: float, queues: tuple[Queue[Any], ...]) -> None:
    import grpc

    ports_out, ports_in, start_in, done_out = queues
    loop = asyncio.get_running_loop()
    payload = os.urandom(MESSAGE)
    server: Any
    if transport == "grpc":
        server = grpc.aio.server()

        async def echo(requests: Any, context: Any) -> Any:
            async for message in requests:
                yield message

        handler = grpc.stream_stream_rpc_method_handler(
            echo, request_deserializer=_identity, response_serializer=_identity
        )
        server.add_generic_rpc_handlers(
            (grpc.method_handlers_generic_handler("floor.Echo", {"Echo": handler}),)
        )
        port = server.add_insecure_port("127.0.0.1:0")
        await server.start()
    else:
        server = await loop.create_server(_Echo, "127.0.0.1", 0)
        port = server.sockets[0].getsockname()[1]
    ports_out.put((rank, port))
    ports: dict[int, int] = await asyncio.to_thread(ports_in.get)
    others = [j for j in ports if j != rank]
    per_peer = max(1, int(mb * 1e6 / len(ports)) // MESSAGE)
    channels: dict[int, Any] = {}
    sinks: dict[int, _Sink] = {}
    for j in others:
        if transport == "grpc":
            channels[j] = grpc.aio.insecure_channel(f"127.0.0.1:{ports[j]}")
        else:
            _, sinks[j] = await loop.create_connection(_Sink, "127.0.0.1", ports[j])

    async def grpc_part(j: int) -> None:
        call = channels[j].stream_stream(
            "/floor.Echo/Echo", request_serializer=_identity, response_deserializer=_identity
        )()

        async def send() -> None:
            for _ in range(per_peer):
                await call.write(payload)
            await call.done_writing()

        sender = loop.create_task(send())
        async for _ in call:
            pass
        await sender

    async def tcp_part(j: int) -> None:
        sink = sinks[j]
        sink.received, sink.expected = 0, per_peer * MESSAGE
        sink.done = loop.create_future()
        for _ in range(per_peer):
            sink.transport.write(payload)
            if sink.writable is not None:
                await sink.writable
        await sink.done

    part = grpc_part if transport == "grpc" else tcp_part
    for _ in range(ROUNDS + 1):
        start_at = await asyncio.to_thread(start_in.get)
        await asyncio.sleep(max(0.0, start_at - time.time()))
        cpu = _cpu()
        await asyncio.gather(*(part(j) for j in others))
        done_out.put((time.time() - start_at, _cpu() - cpu))
    await asyncio.to_thread(start_in.get)  # everyone is done: stop serving
    for channel in channels.values():
        await channel.close()
    for sink in sinks.values():
        sink.transport.close()
    if transport == "grpc":
        await server.stop(None)
    else:
        server.close()


def _worker_main(*args: Any) -> None:
    import uvloop

    uvloop.install()
    asyncio.run(_worker(*args))


def measure(n: int, transport: str, mb: float) -> dict[str, Any]:
    ctx = mp.get_context("spawn")
    ports_q, done_q = ctx.Queue(), ctx.Queue()
    ins = [(ctx.Queue(), ctx.Queue()) for _ in range(n)]
    procs = [
        ctx.Process(
            target=_worker_main, args=(i, transport, mb, (ports_q, ins[i][0], ins[i][1], done_q))
        )
        for i in range(n)
    ]
    for p in procs:
        p.start()
    try:
        ports = dict(ports_q.get(timeout=60) for _ in range(n))
        for ports_in, _ in ins:
            ports_in.put(ports)
        walls, cpus = [], []
        for r in range(ROUNDS + 1):  # round 0 warms up connections
            start_at = time.time() + 0.3
            for _, start_in in ins:
                start_in.put(start_at)
            results = [done_q.get(timeout=120) for _ in range(n)]
            if r:
                walls.append(max(w for w, _ in results))
                cpus.append(sum(c for _, c in results))
        for _, start_in in ins:
            start_in.put(None)
    finally:
        for p in procs:
            p.join(timeout=30)
            if p.is_alive():
                p.kill()
    return {
        "peers": n,
        "transport": transport,
        "seconds_median": round(statistics.median(walls), 4),
        "cpu_seconds_all_peers_median": round(statistics.median(cpus), 4),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--peers", default="2,4,8")
    parser.add_argument("--transports", default="grpc,tcp")
    parser.add_argument("--mb", type=float, default=64.0, help="MB each peer holds")
    args = parser.parse_args()
    results = [
        measure(int(n), transport, args.mb)
        for n in args.peers.split(",")
        for transport in args.transports.split(",")
    ]
    print(
        json.dumps(
            {
                "benchmark": "transport_floor",
                "mb_per_peer": args.mb,
                "load_average": os.getloadavg(),
                "results": results,
            }
        )
    )


if __name__ == "__main__":
    main()
