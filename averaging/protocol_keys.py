"""The DHT keys the averaging layer relies on, and the only records each of them accepts.

Every key below is a dictionary of owner-signed entries: each peer writes one subkey that
names it (``[owner:<peer id hex>]`` at the subkey's end) and that the DHT makes it sign
(dht/validation.py). A plain value or an unowned subkey under these keys would otherwise
replace every peer's entries and then refuse theirs as outdated, which blocks the run
(one ``client.dht.store(f"{run}.{key}.0b", "x")`` failed every peer's next
``average`` with ``NoGroupError``). :func:`protocol_key_classes` describes them to the DHT;
the peer daemon registers them in its ``DHTConfig.key_classes``, so every daemon and bare
DHT node of the run refuses other records there when asked to store them and ignores them in
the answers it reads.

===============================  ==========================================  ===============
key                              written by                                  value
===============================  ==========================================  ===============
``{run}.{key}.0b{bits}``         matchmaking (matchmaking/keys.py)            a declaration
``{run}.state``                  state sharing (state/sharer.py)              an advert
``{run}.averagers``              matchmaking (matchmaking/roster.py)          a presence
``{run}.trainers``               training wrappers (run_records/trainers.py)  a trainer entry
``<anything>.progress``          progress tracking (run_records/progress.py)  a progress
``{run}.rounds``                 the daemon, for monitors                     a round report
                                 (peer/daemon/round_reports.py)
===============================  ==========================================  ===============

Every class caps its records' lifetime at :data:`PROTOCOL_KEY_MAX_TTL` (an hour): the
daemon refreshes these records every few seconds to minutes, and a record that claims to live
for days (the DHT's general cap is a week) would otherwise keep a dead or hostile entry on k
replicas long after its writer left. A longer one is refused by storing nodes and readers.

``{run}`` is the daemon's run id. Progress keys are named by the training run
(``{training run}.progress``, ``{training run}.diloco.progress``), which the daemon does not
know, so every key ending in ``.progress`` is one.
"""

from __future__ import annotations

import re
from typing import Any

from swarmavg.averaging.matchmaking.declarations import decode_declaration
from swarmavg.averaging.matchmaking.keys import MAX_GROUP_BITS
from swarmavg.averaging.matchmaking.roster import PRESENCE_SUFFIX, decode_presence
from swarmavg.averaging.run_records.progress import PeerProgress
from swarmavg.averaging.run_records.trainers import TRAINERS_SUFFIX, TrainerEntry
from swarmavg.averaging.state.adverts import parse_advertisement
from swarmavg.dht.records import Subkey
from swarmavg.dht.validation import KeyClass

PROGRESS_SUFFIX = ".progress"

PROTOCOL_KEY_MAX_TTL = 3600.0
"""Seconds: the longest a record under a protocol key may live (declarations expire when
their round gives up, adverts and progress records are refreshed every ttl/3)."""


def _is_declaration(subkey: Subkey, owner: bytes, value: Any) -> bool:
    return decode_declaration(subkey, value) is not None


def _is_presence(subkey: Subkey, owner: bytes, value: Any) -> bool:
    return decode_presence(subkey, value) is not None


def _is_advertisement(subkey: Subkey, owner: bytes, value: Any) -> bool:
    return parse_advertisement(subkey, value) is not None


def _is_trainer_entry(subkey: Subkey, owner: bytes, value: Any) -> bool:
    return TrainerEntry.from_record(value) is not None


def _is_progress(subkey: Subkey, owner: bytes, value: Any) -> bool:
    # The record names its daemon, which must be the owner that signed it: one identity
    # cannot speak for other daemons (the swarm counts daemons as group members).
    record = PeerProgress.from_record(value)
    return record is not None and record.peer_id == owner.hex()


def _is_round_report(subkey: Subkey, owner: bytes, value: Any) -> bool:
    # Only the owner's claim is checked here: the report's schema belongs to the peer layer
    # above (peer/daemon/round_reports.py), whose reader checks every field again.
    return isinstance(value, dict) and value.get("peer") == owner.hex()


def protocol_key_classes(run_id: str) -> tuple[KeyClass, ...]:
    """The key classes of run ``run_id``'s protocol keys, for ``DHTConfig.key_classes``.

    Raises:
        ValueError: an empty run id.
    """
    if not run_id:
        raise ValueError("run_id must not be empty")
    run = re.escape(run_id.encode())
    return (
        KeyClass(
            "matchmaking declarations",
            re.compile(rb"%s\..+\.0b[01]{0,%d}" % (run, MAX_GROUP_BITS), re.DOTALL),
            _is_declaration,
            PROTOCOL_KEY_MAX_TTL,
        ),
        KeyClass(
            "state adverts",
            re.compile(rb"%s\.state" % run),
            _is_advertisement,
            PROTOCOL_KEY_MAX_TTL,
        ),
        KeyClass(
            "averager presence",
            re.compile(run + re.escape(PRESENCE_SUFFIX.encode())),
            _is_presence,
            PROTOCOL_KEY_MAX_TTL,
        ),
        KeyClass(
            "trainer entries",
            re.compile(run + re.escape(TRAINERS_SUFFIX.encode())),
            _is_trainer_entry,
            PROTOCOL_KEY_MAX_TTL,
        ),
        KeyClass(
            "progress records",
            re.compile(rb".+" + re.escape(PROGRESS_SUFFIX.encode()), re.DOTALL),
            _is_progress,
            PROTOCOL_KEY_MAX_TTL,
        ),
        KeyClass(
            "round reports",
            re.compile(rb"%s\.rounds" % run),
            _is_round_report,
            PROTOCOL_KEY_MAX_TTL,
        ),
    )
