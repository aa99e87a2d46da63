"""Faults from outside, under the service's sandboxes: containers killed, starts that fail, a full pool,
idle expiry and the end of a session's lifetime.

Every wait is bounded (``anyio.fail_after`` / ``wait_until``); leak checks look only at this
process's containers and volumes (other test runs share the engine).
"""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from typing import Any, Literal

import anyio
import pytest
from _support import make_test_config, project_containers, project_volumes, wait_until

from mcp_code_exec.errors import PoolBusy, SessionNotFound
from mcp_code_exec.runtime.base import LABEL_OWNER
from mcp_code_exec.sandbox.container import Sandbox
from mcp_code_exec.sandbox.ownership import owner_token
from mcp_code_exec.service.facade import SandboxService
from mcp_code_exec.service.sessions import Session

pytestmark = pytest.mark.anyio
OWNER = "faults"


async def docker_kill(container_id: str) -> None:
    await anyio.run_process(["docker", "kill", container_id], check=False)


def live_session(service: SandboxService, session_id: str) -> Session:
    return service.sessions.get(session_id, OWNER)


@pytest.fixture
async def small_service() -> AsyncIterator[SandboxService]:
    """A service of its own, so a test may break its pool without disturbing others."""
    config = make_test_config(pool={"size": 1, "max_size": 1, "session_spares": 0, "acquire_timeout_s": 2})
    async with SandboxService.start(config) as svc:
        await svc.wait_ready()
        yield svc


# -- 1. a session container that dies -----------------------------------------------------------
async def test_a_session_container_killed_from_outside_comes_back_with_its_files(service: SandboxService) -> None:
    info = await service.new_session(OWNER)
    sid = info.session_id
    try:
        await service.write_file(OWNER, sid, "written.txt", b"by write_file")
        first = await service.run(
            OWNER, "import os; open('ran.txt', 'w').write('by a run'); lost = 1; os.getuid()", session_id=sid
        )
        assert first.status == "ok", first
        session = live_session(service, sid)
        assert session.sandbox is not None
        old = session.sandbox
        await docker_kill(old.container_id)
        with anyio.fail_after(30):
            await old.channel.closed.wait()  # the host noticed: the attach stream ended

        after = await service.run(OWNER, "open('written.txt').read() + ' / ' + open('ran.txt').read()", session_id=sid)
        assert after.status == "ok", after
        assert after.session_restarted is True
        assert after.result == "'by write_file / by a run'"
        # The new container runs as the uid that owns the volume's files, so they stay writable.
        again = await service.run(OWNER, "import os; open('ran.txt', 'a').write(' again'); os.getuid()", session_id=sid)
        assert again.status == "ok" and again.result == first.result, (first, again)
        assert session.sandbox is not None and session.sandbox.container_id != old.container_id
        gone = await service.run(OWNER, "lost", session_id=sid)
        assert gone.status == "error" and gone.error is not None and gone.error.type == "NameError"
        assert gone.session_restarted is False  # reported once, by the run that found the new container
        await wait_until(lambda: old.container_id not in project_containers(), 30)
    finally:
        await service.close_session(OWNER, sid)


async def test_a_refused_install_after_a_lost_container_still_reports_the_restart(service: SandboxService) -> None:
    sid = (await service.new_session(OWNER)).session_id
    try:
        assert (await service.run(OWNER, "lost = 1", session_id=sid)).status == "ok"
        old = live_session(service, sid).sandbox
        assert old is not None
        await docker_kill(old.container_id)
        with anyio.fail_after(30):
            await old.channel.closed.wait()
        refused = await service.run(OWNER, "%pip install 'unclosed", session_id=sid)  # refused before it runs
        assert refused.status == "error" and refused.error is not None, refused
        assert refused.error.type == "PackageError" and refused.session_restarted, refused
    finally:
        await service.close_session(OWNER, sid)


async def test_a_session_container_killed_during_a_run_reports_crashed_then_recovers(service: SandboxService) -> None:
    info = await service.new_session(OWNER)
    sid = info.session_id
    try:
        await service.write_file(OWNER, sid, "kept.txt", b"kept")
        session = live_session(service, sid)
        assert session.sandbox is not None
        victim = session.sandbox.container_id
        async with anyio.create_task_group() as tg:

            async def kill_when_running() -> None:
                await wait_until(lambda: session.busy > 0, 10)
                await docker_kill(victim)

            tg.start_soon(kill_when_running)
            with anyio.fail_after(60):
                during = await service.run(OWNER, "import time; time.sleep(30)", session_id=sid, timeout=40)
        assert during.status == "crashed"
        assert during.session_restarted is True
        assert during.error is not None and "state was lost" in during.error.message
        with anyio.fail_after(60):
            after = await service.run(OWNER, "open('kept.txt').read()", session_id=sid)
        assert after.status == "ok" and after.result == "'kept'"
        assert after.session_restarted is True
    finally:
        await service.close_session(OWNER, sid)


async def test_a_session_run_that_exhausts_memory_is_reported_and_the_session_keeps_its_files(
    service: SandboxService,
) -> None:
    # The whole container cannot be OOM-killed from user code: the agent marks its workers as
    # the OOM killer's first choice (oom_score_adj 1000) and the supervisor cannot be picked
    # before them. What user code can do is exhaust memory; that must cost only the worker.
    info = await service.new_session(OWNER)
    sid = info.session_id
    try:
        await service.run(OWNER, "open('kept.txt', 'w').write('kept'); x = 1", session_id=sid)
        blown = await service.run(OWNER, "b = bytearray(10**10)", session_id=sid, timeout=30)
        assert blown.status in ("memory_limit", "error"), blown  # MemoryError is an honest outcome too
        after = await service.run(OWNER, "open('kept.txt').read()", session_id=sid)
        assert after.status == "ok" and after.result == "'kept'"
    finally:
        await service.close_session(OWNER, sid)


# -- 2. the pool under faults -------------------------------------------------------------------
@pytest.mark.parametrize(
    "broken", [{"runtime": "no-such-runtime"}, {"image": "mcp-code-exec-base:bookworm"}], ids=["runtime", "image"]
)
async def test_a_container_that_cannot_start_is_retried_with_backoff_and_reported(
    broken: dict[str, Any], caplog: pytest.LogCaptureFixture
) -> None:
    if "image" in broken:
        # An image that exists but has no agent: the start fails after the container is created.
        found = await anyio.run_process(["docker", "image", "inspect", broken["image"]], check=False)
        if found.returncode != 0:
            pytest.skip(f"{broken['image']} (the offline base image) is not present on this engine")
    config = make_test_config(pool={"size": 1, "session_spares": 0, "acquire_timeout_s": 1}, **broken)
    caplog.set_level(logging.WARNING, logger="mcp_code_exec.sandbox.pool")
    async with SandboxService.start(config) as service:
        pool = service.stateless_pool
        await wait_until(lambda: pool.failures >= 3, 60)
        # Each failed round waits, twice as long as the last: no tight loop against the engine.
        assert list(pool.recent_backoffs)[:2] == [0.5, 1.0]
        assert pool.failures <= len(pool.recent_backoffs) + 1
        with anyio.fail_after(30), pytest.raises(PoolBusy, match=r"starting one failed \(.+\); retry"):
            await service.run(OWNER, "1")
    assert any("container start failed" in r.getMessage() for r in caplog.records)
    # Nothing of the failed starts stays behind (neither created-but-not-started nor exited).
    await wait_until(lambda: not stopped_containers(owner_token()), 30)


def stopped_containers(owner: str) -> list[str]:
    import docker

    client = docker.from_env()
    try:
        filters = {"label": f"{LABEL_OWNER}={owner}", "status": ["created", "exited", "dead"]}
        return [c["Id"] for c in client.api.containers(all=True, filters=filters)]
    finally:
        client.close()


async def test_the_pool_backoff_doubles_up_to_its_cap() -> None:
    from mcp_code_exec.errors import EngineError
    from mcp_code_exec.sandbox.pool import WarmPool

    waits: list[float] = []
    enough = anyio.Event()

    async def fake_sleep(seconds: float) -> None:
        waits.append(seconds)
        if len(waits) >= 8:
            enough.set()
        await anyio.lowlevel.checkpoint()

    async def failing_starter() -> Any:
        raise EngineError("the Docker engine refused: no")

    async with WarmPool(
        "t", failing_starter, size=2, acquire_timeout_s=0.1, max_backoff_s=4.0, sleep=fake_sleep
    ) as pool:
        with anyio.fail_after(10):
            await enough.wait()
        assert waits[:8] == [0.5, 1.0, 2.0, 4.0, 4.0, 4.0, 4.0, 4.0]
        assert pool.failures >= 2 * 8  # both missing containers are tried in each round, then one wait
        with pytest.raises(PoolBusy, match=r"starting one failed .*refused: no.*retry"):
            await pool.acquire()


async def test_when_every_container_is_busy_a_call_waits_a_bounded_time_then_gets_pool_busy(
    small_service: SandboxService,
) -> None:
    service = small_service
    assert service.stateless_pool.idle == 1
    async with anyio.create_task_group() as tg:
        outcome: dict[str, Any] = {}

        async def hog() -> None:
            outcome["hog"] = await service.run(OWNER, "import time; time.sleep(50)", timeout=55)

        tg.start_soon(hog)
        await wait_until(lambda: service.stateless_pool.idle == 0, 10)
        with anyio.fail_after(30), pytest.raises(PoolBusy, match=r"busy for \d+ s; retry shortly"):
            await service.run(OWNER, "1")
        tg.cancel_scope.cancel()  # the caller of the long run goes away: it is interrupted
    assert "hog" not in outcome
    with anyio.fail_after(60):
        after = await service.run(OWNER, "print('free again')")
    assert after.status == "ok" and after.stdout == "free again\n"


async def test_a_warm_container_that_died_while_idle_is_replaced_and_the_next_run_works(
    small_service: SandboxService,
) -> None:
    pool = small_service.stateless_pool
    await wait_until(lambda: pool.idle == pool.size, 60)
    dead = pool.container_ids()
    for container_id in dead:
        await docker_kill(container_id)
    # The health check: the pool sees the channel close, drops the container and starts another.
    await wait_until(lambda: pool.idle == pool.size and not (pool.container_ids() & dead), 60)
    assert pool.died_idle >= len(dead)
    result = await small_service.run(OWNER, "print('still works')")
    assert result.status == "ok" and result.stdout == "still works\n"
    await wait_until(lambda: not (set(project_containers()) & dead), 30)


# -- 6. idle timeout and lifetime -------------------------------------------------------------
@pytest.fixture
async def expiring_service() -> AsyncIterator[SandboxService]:
    config = make_test_config(pool={"size": 1, "session_spares": 1}, sessions={"idle_timeout_s": 1.0})
    async with SandboxService.start(config) as svc:
        await svc.wait_ready()
        yield svc


async def test_an_idle_session_is_closed_and_its_container_and_volume_removed(expiring_service: SandboxService) -> None:
    service = expiring_service
    sid = (await service.new_session(OWNER)).session_id
    await service.write_file(OWNER, sid, "f.txt", b"x")
    session = live_session(service, sid)
    assert session.sandbox is not None and session.volume is not None
    container_id, volume = session.sandbox.container_id, session.volume
    await wait_until(lambda: session.closed, 30)
    await wait_until(lambda: container_id not in project_containers() and volume not in project_volumes(), 30)
    with pytest.raises(SessionNotFound):
        await service.run(OWNER, "1", session_id=sid)


async def test_a_run_longer_than_the_idle_timeout_finishes_and_the_session_expires_only_after(
    expiring_service: SandboxService,
) -> None:
    service = expiring_service
    sid = (await service.new_session(OWNER)).session_id
    session = live_session(service, sid)
    # Three idle timeouts long: a reaper that counted a busy session as idle would cancel it.
    with anyio.fail_after(60):
        result = await service.run(OWNER, "import time; time.sleep(3); 'finished'", session_id=sid, timeout=30)
    assert result.status == "ok" and result.result == "'finished'"
    assert result.session_id == sid
    await wait_until(lambda: session.closed, 30)
    with pytest.raises(SessionNotFound):
        await service.run(OWNER, "1", session_id=sid)


async def test_a_session_past_its_lifetime_is_closed_even_if_used() -> None:
    config = make_test_config(pool={"size": 1, "session_spares": 0}, sessions={"max_lifetime_s": 2.0})
    async with SandboxService.start(config) as service:
        sid = (await service.new_session(OWNER)).session_id
        session = live_session(service, sid)
        assert session.volume is not None
        volume = session.volume

        async def keep_using() -> None:
            while not session.closed:
                try:
                    await service.run(OWNER, "1", session_id=sid)
                except SessionNotFound:
                    return

        with anyio.fail_after(60):
            await keep_using()
        await wait_until(lambda: volume not in project_volumes(), 30)


async def test_a_session_closed_while_its_new_container_starts_leaves_nothing_running(
    service: SandboxService, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The run that finds the session's container dead starts another; a close meanwhile must not
    # leave that one (and its volume) running past the session, outside every per-client limit.
    info = await service.new_session(OWNER)
    sid = info.session_id
    session = live_session(service, sid)
    assert session.sandbox is not None and session.volume is not None
    old, volume = session.sandbox, session.volume
    await docker_kill(old.container_id)
    with anyio.fail_after(30):
        await old.channel.closed.wait()
    starting = anyio.Event()
    started: list[Sandbox] = []
    start = service.containers.start

    async def noted(kind: Literal["stateless", "session"], volume: str | None = None) -> Sandbox:
        if volume is not None:
            starting.set()
        sandbox = await start(kind, volume)
        started.append(sandbox)
        return sandbox

    monkeypatch.setattr(service.containers, "start", noted)
    run = await service.start_run(OWNER, "print('ran')", session_id=sid)
    with anyio.fail_after(30):
        await starting.wait()
    await service.close_session(OWNER, sid)
    with anyio.fail_after(60):
        await run.finished.wait()
    assert run.result is not None and run.result.status != "ok", run.result
    assert len(started) == 1
    await wait_until(lambda: started[0].container_id not in project_containers(instance=service.instance), 60)
    await wait_until(lambda: volume not in project_volumes(instance=service.instance), 60)
