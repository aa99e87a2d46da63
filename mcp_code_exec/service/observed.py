"""What a running service shows in its metrics at scrape time: pools, open sessions, engines.

The figures are read from the same places as /healthz's, when Prometheus asks, so the two agree.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

from ..observability import metrics

if TYPE_CHECKING:
    from .facade import SandboxService

ONE_ENGINE = "default"  # the engine's name when there is one (several are named in [cluster])


def watch_service(service: SandboxService) -> metrics.Watched:
    """Show ``service``'s live state in the metrics while the returned object (kept by the service) lives."""
    return metrics.watch(
        metrics.Watched(
            pools=[service.stateless, service.spares],
            open_sessions=lambda: len(service.sessions),
            engines=lambda: engines(service),
        )
    )


def engines(service: SandboxService) -> list[dict[str, Any]]:
    """Per engine: its name, whether it answers, and this server's containers on it."""
    several = service.engine_figures()
    if several is not None:
        return [
            {"name": each["name"], "up": each["up"], "containers": each["stateless"] + each["session_containers"]}
            for each in several
        ]
    in_sessions = sum(1 for session in service.sessions.all() if session.sandbox is not None)
    held = service.stateless.owned + service.spares.owned + in_sessions
    return [{"name": ONE_ENGINE, "up": True, "containers": held}]
