"""swarmavg.dht: the Kademlia DHT that peers use to find each other and keep expiring records."""

from swarmavg.dht.channels import ChannelPool
from swarmavg.dht.identity import HeaderError, Identity, verify_header

__all__ = ["ChannelPool", "HeaderError", "Identity", "verify_header"]
