"""The ``swarmavg`` command line: the parser and commands (main.py), ``swarmavg run`` (run.py),
``swarmavg monitor``'s flags (monitor.py), ``swarmavg launch``, the status and peers tables, and
a long-running command's process life (process.py). ``python -m swarmavg.peer.cli`` runs it.
"""
