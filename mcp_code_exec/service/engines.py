"""Which engine the service runs on: the one engine found (the default), or several (``[cluster]``).

With several, each is a member of a ``ClusterEngine`` (``runtime.cluster``), admitted when it
answers: the sandbox image must be there and current, and what dead servers left there is swept
(at start, and again whenever an engine that was out comes back).
"""

from __future__ import annotations

import functools
from collections import Counter
from collections.abc import Iterable
from typing import Any

from ..config.cluster import ClusterSettings
from ..errors import ImageMissing
from ..runtime.base import ContainerEngine
from ..runtime.cluster import ClusterEngine
from ..runtime.members import Member
from ..sandbox.image import require_current_image
from ..sandbox.ownership import sweep
from .sessions import Session


async def open_engine(settings: ClusterSettings, docker_host: str | None, wait_s: float, image: str) -> ContainerEngine:
    """The engine the configuration names: ``docker_host`` (or the one found), or ``[cluster]``'s
    engines; answering (``wait_s``, the configuration's ``engine_wait_s``, for the first to answer).
    ``image``: the sandboxes', which an engine's disk helper runs."""
    from ..runtime.docker.engine import DockerEngine

    if not settings.engines:
        return await DockerEngine.connect_waiting(docker_host, wait_s, disk_image=image)
    cluster = make_cluster(settings, image)
    try:
        await cluster.health.connect(wait_s)
    except BaseException:
        await cluster.aclose()
        raise
    return cluster


def make_cluster(settings: ClusterSettings, image: str) -> ClusterEngine:
    from ..runtime.docker.engine import DockerEngine

    members = []
    for engine in settings.engines:
        assert engine.name is not None  # the settings name every engine
        cert_path = None if engine.cert_path is None else str(engine.cert_path)
        connect = functools.partial(
            DockerEngine.connect,
            engine.url,
            timeout_s=settings.health_timeout_s,
            cert_path=cert_path,
            disk_image=image,
        )
        members.append(Member(name=engine.name, connect=connect, capacity=engine.capacity))
    return ClusterEngine(
        members,
        admit=functools.partial(admit, image=image),
        interval_s=settings.health_interval_s,
        timeout_s=settings.health_timeout_s,
    )


async def admit(engine: ContainerEngine, *, image: str) -> None:
    """An engine of several may take sandboxes: the image is there and current; the leftovers of
    servers that are gone are removed (ours, and other live servers', are left alone)."""
    try:
        await require_current_image(engine, image)
    except ImageMissing as exc:
        raise ImageMissing(f"{exc}; or copy it there: docker save {image} | docker -H {engine.endpoint} load") from None
    await sweep(engine)


def engine_figures(engine: ContainerEngine, sessions: Iterable[Session]) -> list[dict[str, Any]] | None:
    """Per engine of several: in or out, its capacity, containers, volumes and sessions (names, never
    URLs: /healthz answers anyone). None with one engine."""
    if not isinstance(engine, ClusterEngine):
        return None
    where = Counter(engine.volume_home(session.volume) for session in sessions if session.volume is not None)
    return [{**figures, "sessions": where[figures["name"]]} for figures in engine.health.figures()]
