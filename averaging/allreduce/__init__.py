"""The butterfly all-reduce (DESIGN 5.2).

Partition and load balancing (pure), the runner (one member's side of a round), the
per-round reducer, the daemon-wide reduce service, its wire format and the data plane.
"""
