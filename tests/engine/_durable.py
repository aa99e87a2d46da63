"""Plumbing of the durable-session tests: a durable service of their own, what the engine holds of
a session (its containers, its record), and the removal of everything a test's sessions left.

The suite's other services are not durable (see ``make_test_config``); these turn it on, and close
every session they made, so that neither a volume nor a record outlives them.
"""

from __future__ import annotations

import subprocess
from collections.abc import AsyncIterator, Iterable
from contextlib import asynccontextmanager
from typing import Any

from _support import make_test_config, project_containers, project_volumes

from mcp_code_exec.errors import SandboxError
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.runtime.base import LABEL_INSTANCE, LABEL_KIND, LABEL_SESSION, LABEL_VOLUME
from mcp_code_exec.service.facade import SandboxService

OWNER = "durable"
MIB = 1024 * 1024


def durable_config(**overrides: Any) -> Any:
    """A durable service with small quotas and one warm container (``overrides`` by section)."""
    sessions = {"durable": True, "max_sessions": 6, "max_per_client": 6, **overrides.pop("sessions", {})}
    limits = {"session_data_mb": 64, "session_max_files": 500, "session_disk": "agent", **overrides.pop("limits", {})}
    pool = {"size": 1, "session_spares": 0, **overrides.pop("pool", {})}
    return make_test_config(sessions=sessions, limits=limits, pool=pool, **overrides)


@asynccontextmanager
async def durable_service(config: Any = None) -> AsyncIterator[SandboxService]:
    """A durable service; every session it still holds at the end is closed (so its volume and record
    go), and nothing of it is left on the engine."""
    async with SandboxService.start(config or durable_config()) as service:
        await service.wait_ready()
        try:
            yield service
        finally:
            for session in list(service.sessions.all()):
                await service.keeper.close(session)
    assert project_containers(instance=service.instance) == []
    assert project_volumes(instance=service.instance) == []


def host(*args: str) -> str:
    """A command's output on this machine (the engine's host: the tests run beside it)."""
    done = subprocess.run(args, capture_output=True, text=True, timeout=60, check=False)
    return done.stdout


def docker(*args: str) -> str:
    return host("docker", *args)


def session_containers(service: SandboxService) -> list[str]:
    """Running containers of the service's sessions (its warm stateless ones are not counted)."""
    listed = docker(
        "ps",
        "-q",
        "--filter",
        f"label={LABEL_INSTANCE}={service.instance}",
        "--filter",
        f"label={LABEL_KIND}=session",
    )
    return listed.split()


def copy_helpers(instance: str) -> list[str]:
    """Every copy helper of a service, running or not."""
    listed = docker(
        "ps",
        "-a",
        "-q",
        "--filter",
        f"label={LABEL_INSTANCE}={instance}",
        "--filter",
        f"label={LABEL_KIND}=copy-helper",
    )
    return listed.split()


def records_of(session_ids: Iterable[str]) -> dict[str, str]:
    """The record volumes naming these sessions, each with the data volume it names."""
    found: dict[str, str] = {}
    for session_id in session_ids:
        for name in docker("volume", "ls", "-q", "--filter", f"label={LABEL_SESSION}={session_id}").split():
            found[name] = docker(
                "volume", "inspect", "--format", f'{{{{index .Labels "{LABEL_VOLUME}"}}}}', name
            ).strip()
    return found


def snapshot_written(session_id: str, image: str) -> bool:
    """Whether the session's volume holds a complete snapshot (read by a throwaway container, the
    volume read-only): what a server killed after it can restore."""
    for volume in records_of([session_id]).values():
        probe = subprocess.run(
            ["docker", "run", "--rm", "--network", "none", "-v", f"{volume}:/d:ro", "--entrypoint", "test", image,
             "-s", "/d/.mcpx/snapshot/ns.pkl"],
            capture_output=True, check=False,
        )  # fmt: skip
        return probe.returncode == 0
    return False


def remove_sessions(session_ids: Iterable[str]) -> None:
    """Remove what a test's sessions may have left on the engine (after a failure): their records and
    data volumes. Their containers belong to a server that is gone: the next start sweeps them."""
    for record, volume in records_of(session_ids).items():
        for name in (record, volume):
            if name:
                docker("volume", "rm", "-f", name)


async def agent_restores(service: SandboxService) -> bool:
    """Whether the image's agent answers Restore (keeps snapshots), or predates it ("unknown op")."""
    session_id = (await service.new_session(OWNER)).session_id
    try:
        sandbox = service.sessions.get(session_id, OWNER).sandbox
        assert sandbox is not None
        event, _ = await sandbox.request(wire.Restore())
    except SandboxError:
        return False
    finally:
        await service.close_session(OWNER, session_id)
    return isinstance(event, wire.Restored)
