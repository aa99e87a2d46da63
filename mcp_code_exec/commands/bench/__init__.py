"""``mcp-code-exec bench``: latency and throughput on the real engine, through the real MCP layer.

One run measures the warm path (an in-memory MCP client, then stdio subprocess servers) and, in
the same run, the same ``print(1+1)`` done as a ``docker run`` per call and as a ``docker exec``
per call, so the ratios hold even on a noisy machine. Targets are printed next to each measurement;
missing one does not fail the command (only runs that fail do). See ``bench/README.md``.

Modules: ``report`` (metrics, the table, the JSON pieces), ``calls`` (what is run, and waits for a
service at rest), ``measure`` (the in-memory measurements), ``outside`` (stdio servers and the naive
baselines), ``command`` (the whole run).
"""

from .command import bench

__all__ = ["bench"]
