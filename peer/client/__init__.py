"""The client library: what a training process loads to talk to its daemon.

``connect``/``connect_async`` (client.py), the calls' transport-free halves, the shared-memory
handoff, tensor packing, endpoint discovery and the errors a user catches. Nothing here
imports the daemon, the monitor or the CLI (tests/test_layout.py checks it); the public names
are re-exported by ``swarmavg.peer``. This file imports nothing, so loading one module of the
room loads only what that module needs.
"""
