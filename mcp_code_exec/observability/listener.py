"""``--metrics-port``: the metrics on a listener of their own (for a stdio server, which has no HTTP).

The library's own HTTP server, in a thread, answering ``GET /metrics`` from the server's registry.
It has no authentication: it binds loopback unless the configuration makes the metrics public.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager

import prometheus_client

from .metrics import REGISTRY


@contextmanager
def metrics_listener(host: str, port: int) -> Iterator[tuple[str, int]]:
    """Serve the metrics on ``host:port`` (0: any free port) until the block ends; yields the
    address the listening socket is bound to."""
    server, thread = prometheus_client.start_http_server(port, addr=host, registry=REGISTRY)
    try:
        yield str(server.server_address[0]), int(server.server_address[1])
    finally:
        server.shutdown()
        server.server_close()
        thread.join(timeout=5)
