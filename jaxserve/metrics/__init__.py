"""What the engine reports: its counters and the snapshots the loggers read, the periodic stats line and the
Prometheus metrics of a server."""
