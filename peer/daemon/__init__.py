"""The daemon (``swarmavg peer``, ``swarmavg dht``) and its local control service.

The ``Peer`` composing the DHT node, the averager and the control service (daemon.py), the
config tree and where each setting comes from, the combiner of a machine's training
processes, the counters and their Prometheus export, and the round reports a daemon
publishes. It may import the client room (the shared-memory and tensor framing both sides
speak), never the CLI. This file imports nothing: ``swarmavg.peer.daemon.config`` loads no
daemon.
"""
