"""swarmavg.dht: the Kademlia DHT that peers use to find each other and keep expiring records.

See docs/dht.md. Public names::

    DHTNode, DHTConfig, Identity, ValueWithExpiration, ChannelPool, BootstrapError, KeyClass

The names are imported on first use (PEP 562), so that a module needing one small piece
(a key's validation rule, a record's suffix) does not load the node, gRPC and the crypto.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from swarmavg.dht.auth import AuthenticationError, Authenticator, RequestSigner
    from swarmavg.dht.channels import ChannelPool
    from swarmavg.dht.config import DHTConfig
    from swarmavg.dht.identity import HeaderError, Identity, verify_header
    from swarmavg.dht.node import BootstrapError, DHTNode
    from swarmavg.dht.records import ValueWithExpiration, owner_suffix
    from swarmavg.dht.routing import Contact
    from swarmavg.dht.validation import DHTLimits, KeyClass, SchemaValidator, ValidationError

_MODULE_OF = {
    "AuthenticationError": "auth",
    "Authenticator": "auth",
    "RequestSigner": "auth",
    "ChannelPool": "channels",
    "DHTConfig": "config",
    "HeaderError": "identity",
    "Identity": "identity",
    "verify_header": "identity",
    "BootstrapError": "node",
    "DHTNode": "node",
    "ValueWithExpiration": "records",
    "owner_suffix": "records",
    "Contact": "routing",
    "DHTLimits": "validation",
    "KeyClass": "validation",
    "SchemaValidator": "validation",
    "ValidationError": "validation",
}


def __getattr__(name: str) -> Any:
    module = _MODULE_OF.get(name)
    if module is None:
        raise AttributeError(f"module 'swarmavg.dht' has no attribute {name!r}")
    return getattr(importlib.import_module(f"swarmavg.dht.{module}"), name)


__all__ = [
    "AuthenticationError",
    "Authenticator",
    "BootstrapError",
    "ChannelPool",
    "Contact",
    "DHTConfig",
    "DHTLimits",
    "DHTNode",
    "HeaderError",
    "Identity",
    "KeyClass",
    "RequestSigner",
    "SchemaValidator",
    "ValidationError",
    "ValueWithExpiration",
    "owner_suffix",
    "verify_header",
]
