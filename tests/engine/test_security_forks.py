"""Forks against the caps of their identity (docs/security.md#forks): past the paused caps (per
identity and in all) or past the identity's disk, a fork is refused before anything is copied, and
another identity still forks; two forks racing cannot both pass; a fork ends when its source would.

Durable services of their own, small caps, sessions counted by the agent (quick to make).
"""

from __future__ import annotations

from typing import Any

import anyio
import pytest
from _durable import OWNER, copy_helpers, docker, durable_config, durable_service, records_of
from _support import project_volumes

from mcp_code_exec.errors import OverQuota, SessionLimit
from mcp_code_exec.runtime.base import LABEL_CREATED
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
OTHER = "durable-other"
QUOTA_MB = 64


def caps(stored_mb: int = 16384, **sessions: Any) -> Any:
    quotas = {"default": {"stored_mb": stored_mb}}
    return durable_config(sessions=sessions, limits={"session_data_mb": QUOTA_MB}, quotas=quotas)


async def refused_before_copying(service: SandboxService, owner: str, source: str, count: int) -> str:
    """The refusal's message; nothing was made for it (no volume, no copy helper, no session)."""
    volumes, sessions = set(project_volumes(instance=service.instance)), len(service.sessions)
    with pytest.raises((SessionLimit, OverQuota)) as refused:
        await service.fork_session(owner, source, count)
    assert set(project_volumes(instance=service.instance)) == volumes
    assert copy_helpers(service.instance) == [] and len(service.sessions) == sessions
    return str(refused.value)


async def test_forks_past_an_identitys_paused_cap_or_the_servers_are_refused_before_copying_and_others_still_fork() -> (
    None
):
    config = caps(max_per_client=2, max_paused=4, max_paused_per_client=2)
    async with durable_service(config) as service:
        source = (await service.new_session(OWNER)).session_id
        assert len(await service.fork_session(OWNER, source, 2)) == 2
        said = await refused_before_copying(service, OWNER, source, 1)
        assert "your limit of 2 paused sessions (forks included)" in said and "you hold 2" in said, said
        # Another identity is not held back by the first one's forks
        theirs = (await service.new_session(OTHER)).session_id
        assert len(await service.fork_session(OTHER, theirs, 1)) == 1
        # One slot left in all: a fork of two is refused whole
        said = await refused_before_copying(service, OTHER, theirs, 2)
        assert "at most 4 paused sessions (all clients together)" in said, said
        assert len(service.sessions.paused()) == 3


async def test_a_fork_or_new_session_past_an_identitys_disk_is_refused_before_copying() -> None:
    config = caps(3 * QUOTA_MB, max_per_client=4, max_paused_per_client=10)
    async with durable_service(config) as service:
        source = (await service.new_session(OWNER)).session_id
        await service.fork_session(OWNER, source, 2)  # three volumes: the identity's disk is full
        said = await refused_before_copying(service, OWNER, source, 1)
        assert f"at most {3 * QUOTA_MB} MiB of disk" in said and "you hold 3" in said, said
        with pytest.raises(OverQuota, match=r"quota stored_mb reached: .* MiB of disk"):
            await service.new_session(OWNER)
        theirs = (await service.new_session(OTHER)).session_id
        assert len(await service.fork_session(OTHER, theirs, 2)) == 2


async def test_two_forks_racing_from_one_identity_cannot_both_pass_its_cap() -> None:
    config = caps(max_per_client=2, max_paused=2, max_paused_per_client=2)
    async with durable_service(config) as service:
        first = (await service.new_session(OWNER)).session_id
        second = (await service.new_session(OWNER)).session_id
        outcomes: list[object] = []

        async def fork(source: str) -> None:
            try:
                outcomes.append(await service.fork_session(OWNER, source, 2))
            except SessionLimit as exc:
                outcomes.append(exc)

        with anyio.fail_after(120):
            async with anyio.create_task_group() as tg:
                tg.start_soon(fork, first)  # two sources: neither waits for the other's lock
                tg.start_soon(fork, second)
        assert sorted(type(outcome).__name__ for outcome in outcomes) == ["SessionLimit", "list"], outcomes
        assert len(service.sessions.paused()) == 2


def recorded_creation(session_id: str) -> str:
    (record,) = records_of([session_id])
    return docker("volume", "inspect", "--format", f'{{{{index .Labels "{LABEL_CREATED}"}}}}', record).strip()


async def test_a_fork_ends_when_its_source_would_and_its_record_says_so() -> None:
    lifetime_s = 600.0
    async with durable_service(caps(max_lifetime_s=lifetime_s)) as service:
        source_id = (await service.new_session(OWNER)).session_id
        await service.run(OWNER, "open('/mnt/data/a.txt', 'w').write('a')", session_id=source_id)
        (fork_id,) = await service.fork_session(OWNER, source_id)
        source, fork = service.sessions.get(source_id, OWNER), service.sessions.get(fork_id, OWNER)
        # The time the next server counts the lifetime from (across a restart: the record's label)
        assert recorded_creation(fork_id) == recorded_creation(source_id)
        assert fork.created_at == source.created_at
        # The reaper's clock at the source's end of life: the fork is due as well, not a lifetime later
        # (a millisecond past it: (created + lifetime) - created can come out a hair under lifetime in floats)
        due = service.sessions.expired(now=source.created + lifetime_s + 1e-3)
        assert {source_id, fork_id} <= {session.id for session in due}
        assert fork not in service.sessions.expired(now=source.created + lifetime_s - 1)
