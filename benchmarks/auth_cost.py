"""CPU cost of message authentication per message, without a network.

Times, in thread CPU time (so other processes' load does not count), what each side of one
message spends on authentication: the sender's digest and signature, the receiver's digest
and check (signature verification and replay cache), for a DHT ``Store`` of one record, a
``JoinGroup`` request and a ``Reduce`` stream opening; and for a DHT exchange in all (both
sides of the request and of the signed answer). Prints ONE JSON line of medians in
microseconds.

    python -m benchmarks.auth_cost --repeats 2000
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time
from collections.abc import Callable, Iterator
from typing import Any

from swarmavg.averaging.allreduce.wire import reduce_digest
from swarmavg.dht.auth import Authenticator, RequestSigner, message_digest
from swarmavg.dht.identity import Identity
from swarmavg.proto import averaging_pb2, dht_pb2

RUN = "bench"
STORE = "/swarmavg.v1.DHT/Store"
JOIN = "/swarmavg.v1.Averaging/JoinGroup"
REDUCE = "/swarmavg.v1.Averaging/Reduce"


def median_us(work: Callable[[], Any], repeats: int) -> float:
    samples = []
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        work()
        samples.append(time.thread_time_ns() - t0)
    return round(statistics.median(samples) / 1e3, 1)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--repeats", type=int, default=2000)
    args = parser.parse_args()
    sender_id, receiver_id = Identity.generate(), Identity.generate()
    sender = RequestSigner(sender_id, RUN, lambda: "127.0.0.1:1")
    receiver = RequestSigner(receiver_id, RUN, lambda: "127.0.0.1:2")
    inbound = Authenticator(receiver_id, RUN, max_nonces=10 * args.repeats)
    outbound = Authenticator(sender_id, RUN)
    record = dht_pb2.Record(key=b"run.key.0b", subkey=b"s" * 40, value=b"v" * 200)
    messages: dict[str, tuple[Callable[[], Any], str, Callable[[Any], bytes]]] = {
        "dht_store": (lambda: dht_pb2.StoreRequest(records=[record]), STORE, message_digest),
        "join_group": (
            lambda: averaging_pb2.JoinRequest(
                key="run.key.0b", schema_hash=b"h" * 32, bandwidth=100.0, declared_start=1.0
            ),
            JOIN,
            message_digest,
        ),
        "reduce_opening": (
            lambda: averaging_pb2.ReduceRequest(group_id=b"g" * 16, part_index=3, weight=1.0),
            REDUCE,
            lambda m: reduce_digest(m.group_id, m.part_index, m.weight, m.chunk_index),
        ),
    }
    out: dict[str, Any] = {"benchmark": "auth_cost", "repeats": args.repeats, "unit": "us"}
    for name, (build, method, digest) in messages.items():
        prepared = [build() for _ in range(args.repeats)]
        signed = iter(prepared)

        def sign(
            method: str = method,
            digest: Callable[[Any], bytes] = digest,
            signed: Iterator[Any] = signed,
        ) -> None:
            message = next(signed)
            message.header.CopyFrom(sender.sign(receiver_id.peer_id, method, digest(message)))

        out[f"{name}_send"] = median_us(sign, args.repeats)
        checked = iter(prepared)

        def check(
            method: str = method,
            digest: Callable[[Any], bytes] = digest,
            checked: Iterator[Any] = checked,
        ) -> None:
            message = next(checked)
            inbound.check(message.header, method, digest(message))

        out[f"{name}_receive"] = median_us(check, args.repeats)

    def exchange() -> None:
        request = dht_pb2.StoreRequest(records=[record])
        request.header.CopyFrom(sender.sign(receiver_id.peer_id, STORE, message_digest(request)))
        inbound.check(request.header, STORE, message_digest(request))
        answer = dht_pb2.StoreResponse(statuses=[dht_pb2.STORE_STATUS_STORED])
        bound = message_digest(answer, bound_to=request.header.nonce)
        answer.header.CopyFrom(receiver.sign_response(request.header, STORE, bound))
        outbound.check_response(answer.header, STORE, bound, receiver_id.peer_id)

    out["dht_exchange_both_sides"] = median_us(exchange, args.repeats)
    out["cpu_count"] = os.cpu_count()
    out["load_average"] = round(os.getloadavg()[0], 2)
    print(json.dumps(out))


if __name__ == "__main__":
    main()
