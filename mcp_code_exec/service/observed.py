"""What a running service shows in its metrics at scrape time: pools, open sessions, engines.

The figures are read from the same places as /healthz's, when Prometheus asks, so the two agree.
"""

from __future__ import annotations

from typing import Any

from ..observability import metrics
from .containers import ContainerFactory
from .engines import engine_figures
from .sessions import SessionRegistry

ONE_ENGINE = "default"  # the engine's name when there is one (several are named in [cluster])


def watch_service(containers: ContainerFactory, sessions: SessionRegistry) -> metrics.Watched:
    """Show the service's live state in the metrics while the returned object (kept by the service) lives."""
    return metrics.watch(
        metrics.Watched(
            pools=[containers.stateless_pool, containers.session_spares],
            open_sessions=lambda: len(sessions),
            engines=lambda: engines(containers, sessions),
        )
    )


def engines(containers: ContainerFactory, sessions: SessionRegistry) -> list[dict[str, Any]]:
    """Per engine: its name, whether it answers, and this server's containers on it."""
    several = engine_figures(containers.engine, sessions.all())
    if several is not None:
        return [
            {"name": each["name"], "up": each["up"], "containers": each["stateless"] + each["session_containers"]}
            for each in several
        ]
    in_sessions = sum(1 for session in sessions.all() if session.sandbox is not None)
    held = containers.stateless_pool.owned + containers.session_spares.owned + in_sessions
    return [{"name": ONE_ENGINE, "up": True, "containers": held}]
