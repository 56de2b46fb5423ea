"""Deployment files for swarmavg and the multi-host network test bed (``deploy.testbed``).

The Dockerfile, compose file, systemd unit and Kubernetes manifests live beside this file;
``deploy.testbed`` is Python, importable with the repository root on ``sys.path``.
"""
