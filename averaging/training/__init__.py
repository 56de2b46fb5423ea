"""The PyTorch-side training wrappers and the swarm's progress tracking (torch imported lazily).

Users import them from :mod:`swarmavg.averaging.optim`."""
