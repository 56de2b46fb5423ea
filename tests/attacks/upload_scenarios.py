"""Slow readers of a donor's state, shared by ``test_state_upload_slots.py`` and
``tests/attacks/attack_report.py``.

Nothing here imports the upload slots themselves, so the report can stage the attack
against older code too.
"""

from __future__ import annotations

from swarmavg.averaging.state.config import StateSharingConfig
from swarmavg.dht.auth import RequestSigner
from swarmavg.dht.identity import Identity
from swarmavg.proto import averaging_pb2
from tests.averaging.averager_swarm import RUN_ID, Peer, fast_config

PATIENT = StateSharingConfig(  # no deadline cuts a slow reader within the test
    chunk_size=1 << 20, message_timeout=120.0, upload_timeout=300.0, max_uploads=8
)
CONFIG = fast_config(state=PATIENT)


def outsider() -> RequestSigner:
    """A fresh identity that is no peer of the swarm (it only signs requests)."""
    return RequestSigner(Identity.generate(), RUN_ID, lambda: "")


def everything(donor: Peer) -> averaging_pb2.StateRequest:
    manifest = donor.averager.state_sharer.published
    assert manifest is not None
    return averaging_pb2.StateRequest(root=manifest.root, chunk_hashes=manifest.chunk_hashes)
