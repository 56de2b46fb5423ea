"""What checking one received DHT record costs a daemon; ONE JSON line.

    python benchmarks/record_validation.py [--records 256] [--repeat 5]

A daemon checks every record it is sent (Store, Find answers) with its run's protocol key
classes (averaging/protocol_keys.py), as ``DHTProtocol.validate`` does. A matchmaking read
receives each declaration from 3 replicas, so most records a daemon checks it has seen
before. Timed, per record (best of ``--repeat``, microseconds):

* ``first_us``: a declaration never seen (signature verified, value decoded and checked);
* ``seen_us``: the same signed bytes again (what the signature cache saves);
* ``decode_us``: ``decode_declaration`` alone, the key class's value check.

To compare two checkouts, run it with each one's package first on ``PYTHONPATH``
(``code`` says which package ran).
"""

from __future__ import annotations

import argparse
import json
import os
import time
import timeit

from swarmavg.averaging.group import Mode
from swarmavg.averaging.matchmaking import declarations as declarations_module
from swarmavg.averaging.matchmaking.declarations import (
    Declaration,
    declaration_subkey,
    decode_declaration,
)
from swarmavg.averaging.protocol_keys import protocol_key_classes
from swarmavg.dht import Identity
from swarmavg.dht.records import (
    StoredRecord,
    pack,
    pack_subkey,
    signing_payload,
    unpack,
    unpack_subkey,
)
from swarmavg.dht.validation import DHTLimits, SignatureCache, validate_record

RUN_ID = "bench"
KEY = b"bench.step.0b"


def declaration_record(identity: Identity, now: float) -> StoredRecord:
    declaration = Declaration(
        peer_id=identity.peer_id,
        address="127.0.0.1:5555",
        start=now,
        deadline=now + 1.0,
        give_up=now + 5.0,
        mode=Mode.NODE,
        bandwidth=1e8,
        schema_hash=os.urandom(32),
        group_size=8,
        codec="float16",
        data_port=4444,
    )
    subkey = pack_subkey(declaration_subkey(identity.peer_id))
    record = StoredRecord(KEY, subkey, pack(declaration.encode()), now + 5.0)
    record.public_key, record.issued = identity.public_key, now
    record.signature = identity.sign(
        signing_payload(RUN_ID, KEY, subkey, record.value, record.expiration, now)
    )
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--records", type=int, default=256)
    parser.add_argument("--repeat", type=int, default=5)
    args = parser.parse_args()
    now = time.time()
    records = [declaration_record(Identity.generate(), now) for _ in range(args.records)]
    key_classes = protocol_key_classes(RUN_ID)
    limits = DHTLimits()

    def check_all(cache: SignatureCache) -> None:
        for record in records:
            validate_record(
                record, limits, now, run_id=RUN_ID, key_classes=key_classes, signatures=cache
            )

    first = min(timeit.repeat(lambda: check_all(SignatureCache()), number=1, repeat=args.repeat))
    seen_cache = SignatureCache()
    check_all(seen_cache)
    seen = min(timeit.repeat(lambda: check_all(seen_cache), number=1, repeat=args.repeat))
    decoded = [
        (unpack_subkey(r.subkey, limits.max_subkey_bytes), unpack(r.value, limits.max_value_bytes))
        for r in records
    ]
    decode = min(
        timeit.repeat(
            lambda: [decode_declaration(s, v) for s, v in decoded], number=1, repeat=args.repeat
        )
    )
    per = 1e6 / len(records)
    print(
        json.dumps(
            {
                "benchmark": "record_validation",
                "code": os.path.dirname(
                    os.path.dirname(os.path.dirname(declarations_module.__file__))
                ),
                "records": len(records),
                "first_us": round(first * per, 2),
                "seen_us": round(seen * per, 2),
                "decode_us": round(decode * per, 2),
            }
        )
    )


if __name__ == "__main__":
    main()
