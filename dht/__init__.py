"""swarmavg.dht: the Kademlia DHT that peers use to find each other and keep expiring records.

See docs/dht.md. Public names::

    DHTNode, DHTConfig, Identity, ValueWithExpiration, ChannelPool, BootstrapError, KeyClass
"""

from swarmavg.dht.auth import AuthenticationError, Authenticator, RequestSigner
from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.config import DHTConfig
from swarmavg.dht.identity import HeaderError, Identity, verify_header
from swarmavg.dht.node import BootstrapError, DHTNode
from swarmavg.dht.records import ValueWithExpiration, owner_suffix
from swarmavg.dht.routing import Contact
from swarmavg.dht.validation import DHTLimits, KeyClass, SchemaValidator, ValidationError

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
