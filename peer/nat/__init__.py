"""Peers behind NAT: reachability by dial-back, a bounded relay on public peers,
and reservations that NATed peers keep at relays (docs/peer.md, "Behind NAT").

Modules: :mod:`limits` (the relay's bounds, pure), :mod:`dialback` (the dial-back's rules and
the reachability check), :mod:`relay` (the relay side: reserved ports, splicing),
:mod:`reservation` (the NATed side: the long-lived stream and the back-connections),
:mod:`service` (the ``Relay`` gRPC service tying them to a daemon).
"""
