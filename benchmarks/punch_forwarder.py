"""What a direct link's local forwarder costs (issue 20, hole punching): grpc.aio cannot adopt
a punched socket, so each daemon joins its local connection to the punched one byte for byte
(peer/nat/splice.py), once on the dialling side and once on the answering side.

On loopback, in one process: a sender streams ``--mb`` MB to a sink (a) directly and (b)
through two splices in a row (the dialler's forwarder and the answerer's join, as on a
direct link). CPU seconds of the process (time.process_time) per run, A/B interleaved over
``--repeats`` runs; the figure is the median extra CPU per GB that the two splices add, and
the throughput of each path. Prints ONE JSON line.

    .venv/bin/python benchmarks/punch_forwarder.py --mb 256 --repeats 7
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import statistics
import sys
import time
from pathlib import Path

REPO = Path(__file__).resolve().parents[1]
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

from swarmavg.peer.nat.splice import splice  # noqa: E402

CHUNK = 1 << 20


async def sink_server() -> tuple[asyncio.Server, int]:
    async def drain(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        while await reader.read(CHUNK):
            pass
        writer.close()

    server = await asyncio.start_server(drain, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def splice_server(target_port: int) -> tuple[asyncio.Server, int]:
    """Accepts a connection and joins it to a new connection to ``target_port``."""
    tasks: set[asyncio.Task[int]] = set()

    def accept(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        async def join() -> int:
            other = await asyncio.open_connection("127.0.0.1", target_port)
            return await splice((reader, writer), other)

        task = asyncio.ensure_future(join())
        tasks.add(task)
        task.add_done_callback(tasks.discard)

    server = await asyncio.start_server(accept, "127.0.0.1", 0)
    return server, server.sockets[0].getsockname()[1]


async def send(port: int, total: int) -> None:
    reader, writer = await asyncio.open_connection("127.0.0.1", port)
    block = os.urandom(CHUNK)
    for _ in range(total // CHUNK):
        writer.write(block)
        await writer.drain()
    writer.write_eof()
    await reader.read()  # the far end closes after the sink drained everything
    writer.close()


async def measure(mb: int, repeats: int) -> dict[str, object]:
    sink, sink_port = await sink_server()
    answerer, answerer_port = await splice_server(sink_port)  # B: joins to its local port
    dialler, dialler_port = await splice_server(answerer_port)  # A: the local forwarder
    total = mb * CHUNK
    cpu: dict[str, list[float]] = {"direct": [], "forwarded": []}
    wall: dict[str, list[float]] = {"direct": [], "forwarded": []}
    for r in range(repeats + 1):
        for name in sorted(cpu, reverse=r % 2 == 1):
            port = sink_port if name == "direct" else dialler_port
            c0, w0 = time.process_time(), time.perf_counter()
            await send(port, total)
            if r > 0:  # the first run warms up
                cpu[name].append(time.process_time() - c0)
                wall[name].append(time.perf_counter() - w0)
    for server in (dialler, answerer, sink):
        server.close()
    gb = total / 1e9
    extra = [(f - d) / gb for d, f in zip(cpu["direct"], cpu["forwarded"], strict=True)]
    return {
        "benchmark": "punch_forwarder",
        "mb": mb,
        "repeats": repeats,
        "cpu_s_per_gb": {k: round(statistics.median(v) / gb, 3) for k, v in cpu.items()},
        "extra_cpu_s_per_gb_two_splices": round(statistics.median(extra), 3),
        "gb_per_s": {k: round(gb / statistics.median(v), 3) for k, v in wall.items()},
        "load_average": round(os.getloadavg()[0], 2),
    }


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=256)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(json.dumps(asyncio.run(measure(args.mb, args.repeats))), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
