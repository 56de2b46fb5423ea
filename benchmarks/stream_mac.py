"""Throughput of a keyed ``Reduce`` stream's MAC, and of the candidates it was chosen from.

Times, in thread CPU time (other processes' load does not count), tagging ``--mb`` MiB in
messages of ``--chunk-kib`` KiB (a chunk's size on the wire) with: keyed BLAKE2b (hashlib),
HMAC-SHA256 (hashlib/OpenSSL), ChaCha20-Poly1305 and AES-256-GCM (GMAC, the one used), each
with the message as associated data only (``cryptography``/OpenSSL) in one buffer, and through
:class:`~swarmavg.averaging.allreduce.stream_mac.StreamMac` as a stream seals a message of two
pieces (its head and its payload, fed to GMAC in turn). Also the
handshake's CPU per stream at each end (X25519, HKDF, a signature, a verification). Prints ONE
JSON line: MB/s per MAC (median of ``--repeats``), handshake microseconds (medians).

    python -m benchmarks.stream_mac --mb 64 --chunk-kib 1024 --repeats 7
"""

from __future__ import annotations

import argparse
import hashlib
import hmac
import os
import statistics
import time
from collections.abc import Callable

from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

from benchmarks.common import emit
from swarmavg.averaging.allreduce.keyed_stream import SenderHandshake, answer
from swarmavg.averaging.allreduce.stream_mac import Direction, StreamMac
from swarmavg.averaging.allreduce.wire import (
    deserialize_reply,
    deserialize_request,
    reduce_digest,
)
from swarmavg.dht.auth import Authenticator, RequestSigner
from swarmavg.dht.identity import Identity

RUN = "bench"


def _mb_per_s(tag: Callable[[memoryview], object], chunks: list[memoryview], repeats: int) -> float:
    total = sum(c.nbytes for c in chunks)
    samples = []
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        for chunk in chunks:
            tag(chunk)
        samples.append(time.thread_time_ns() - t0)
    return round(total / 1e6 / (statistics.median(samples) / 1e9), 1)


def _handshake_us(repeats: int) -> dict[str, float]:
    sender_id, reducer_id = Identity.generate(), Identity.generate()
    sender = RequestSigner(sender_id, RUN, lambda: "")
    reducer = RequestSigner(reducer_id, RUN, lambda: "")
    inbound = Authenticator(reducer_id, RUN, max_nonces=10 * repeats)
    outbound = Authenticator(sender_id, RUN)
    sender_side, reducer_side = [], []
    for _ in range(repeats):
        t0 = time.thread_time_ns()
        handshake = SenderHandshake(sender_id.peer_id, reducer_id.peer_id, b"g" * 16, 1)
        opening = b"".join(handshake.opening(sender, 1.0).pieces)
        t1 = time.thread_time_ns()
        first = deserialize_request(opening)
        assert first.header is not None
        digest = reduce_digest(b"g" * 16, 1, 1.0, 0, first.stream_key)
        inbound.check(first.header, first.header.method, digest)
        reply, _ = answer(first, sender_id.peer_id, reducer)
        wire = b"".join(reply.pieces)
        t2 = time.thread_time_ns()
        handshake.accept(deserialize_reply(wire), outbound)
        t3 = time.thread_time_ns()
        sender_side.append((t1 - t0) + (t3 - t2))
        reducer_side.append(t2 - t1)
    return {
        "sender_us": round(statistics.median(sender_side) / 1e3, 1),
        "reducer_us": round(statistics.median(reducer_side) / 1e3, 1),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mb", type=int, default=64)
    parser.add_argument("--chunk-kib", type=int, default=1024)
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    data = memoryview(os.urandom(args.mb << 20))
    step = args.chunk_kib << 10
    chunks = [data[i : i + step] for i in range(0, len(data), step)]
    key = os.urandom(32)
    mac = StreamMac(key, Direction.TO_REDUCER)
    aead = ChaCha20Poly1305(key)
    gcm = AESGCM(key)
    nonce = bytes(12)
    head = bytes(48)  # a chunk message's small fields, before its payload

    def blake2b(chunk: memoryview) -> object:
        return hashlib.blake2b(chunk, key=key, digest_size=16).digest()

    def hmac_sha256(chunk: memoryview) -> object:
        return hmac.new(key, chunk, "sha256").digest()

    def poly1305(chunk: memoryview) -> object:
        return aead.encrypt(nonce, b"", bytes(chunk))  # one buffer: the pieces joined

    def gmac(chunk: memoryview) -> object:
        return gcm.encrypt(nonce, b"", chunk)

    emit(
        {
            "bench": "stream_mac",
            "mb": args.mb,
            "chunk_kib": args.chunk_kib,
            "mb_per_s": {
                "stream_mac_seal": _mb_per_s(lambda c: mac.seal((head, c)), chunks, args.repeats),
                "aes256gcm_aad": _mb_per_s(gmac, chunks, args.repeats),
                "blake2b": _mb_per_s(blake2b, chunks, args.repeats),
                "hmac_sha256": _mb_per_s(hmac_sha256, chunks, args.repeats),
                "chacha20poly1305_aad": _mb_per_s(poly1305, chunks, args.repeats),
            },
            "handshake": _handshake_us(max(args.repeats * 30, 100)),
        }
    )


if __name__ == "__main__":
    main()
