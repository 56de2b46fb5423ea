"""The butterfly all-reduce (docs/averaging.md, "The butterfly all-reduce").

Partition and load balancing (pure), the runner (one member's side of a round), the
per-round reducer, the daemon-wide reduce service, its wire format and the data plane.
"""
