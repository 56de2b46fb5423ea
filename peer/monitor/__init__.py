"""The monitor (``swarmavg monitor``): a light DHT peer that records a run over time.

The service itself (monitor.py), what it records (series.py), round health and alerts
(health.py), the dashboard's HTTP server and page, and the sinks it writes besides the
dashboard. It reads what daemons publish through the daemon room's records; it never imports
the CLI.
"""
