"""What operators see: Prometheus metrics, OpenTelemetry spans and JSON log lines.

Below every layer that records into it (with ``config``, ``errors`` and ``models``), and the one
home of ``prometheus_client`` and ``opentelemetry``. Callers record with one call each
(``metrics.run_finished(...)``, ``@traced("mcpx.admission")``); labels come only from closed sets
or from the configuration (engine names), never from a session, run or client id or a path.
"""
