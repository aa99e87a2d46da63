"""Helpers for testing against the real engine (used by this project's tests; public on purpose)."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import anyio

from .config import Config, load_config
from .runtime.base import LABEL_OWNER


def make_test_config(**overrides: Any) -> Config:
    """Small limits so the suite is quick and two cores suffice."""
    base: dict[str, Any] = {
        "limits": {"memory_mb": 256, "default_timeout_s": 20, "max_timeout_s": 60},
        "pool": {"size": 2, "session_spares": 1, "acquire_timeout_s": 30},
        "sessions": {"max_sessions": 12},
    }
    for key, value in overrides.items():
        if isinstance(value, dict) and isinstance(base.get(key), dict):
            base[key] = {**base[key], **value}
        else:
            base[key] = value
    return load_config(environ={}, overrides=base)


async def wait_until(predicate: Callable[[], Any], timeout_s: float, *, every_s: float = 0.1) -> None:
    """Poll external state (the engine) until ``predicate()`` is truthy; TimeoutError past the bound."""
    with anyio.fail_after(timeout_s):
        while not await anyio.to_thread.run_sync(predicate):
            await anyio.sleep(every_s)  # pacing of the poll; the predicate is the synchronisation


def ensure_image(config: Config) -> None:
    """Build the sandbox image when it is missing or stale (the test command builds what it needs)."""
    from .image import build, image_is_current

    if not anyio.run(image_is_current, config.image, config.docker_host):
        anyio.run(lambda: build(config.image, docker_host=config.docker_host))


def project_containers(owner: str | None = None) -> list[str]:
    """Ids of containers carrying this project's label (optionally of one owner)."""
    import docker

    client = docker.from_env()
    try:
        label = f"{LABEL_OWNER}={owner}" if owner else LABEL_OWNER
        return [c.id for c in client.containers.list(all=True, filters={"label": label})]
    finally:
        client.close()


def project_volumes(owner: str | None = None) -> list[str]:
    import docker

    client = docker.from_env()
    try:
        label = f"{LABEL_OWNER}={owner}" if owner else LABEL_OWNER
        return [v.name for v in client.volumes.list(filters={"label": label})]
    finally:
        client.close()
