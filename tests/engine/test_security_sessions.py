"""Hostile use of sessions: guessed ids, concurrency, closing and killing mid-run (docs/security.md#sessions)."""

from __future__ import annotations

import anyio
import pytest
from _security import OWNER, assert_answers
from _support import (
    crashing_server,
    make_test_config,
    project_containers,
    project_volumes,
    wait_until,
)

from mcp_code_exec.errors import SessionBusy, SessionNotFound
from mcp_code_exec.models import RunResult
from mcp_code_exec.sandbox.ownership import owner_token
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


def container_exists(container_id: str) -> bool:
    return any(c.startswith(container_id) or container_id.startswith(c) for c in project_containers(owner_token()))


def volume_exists(name: str) -> bool:
    return name in project_volumes(owner_token())


# -- 32. made-up, closed and other clients' session ids ------------------------------------------------------
async def test_unknown_closed_and_foreign_sessions_all_get_the_same_answer(service: SandboxService) -> None:
    mine = await service.new_session(OWNER)
    closed = await service.new_session(OWNER)
    await service.close_session(OWNER, closed.session_id)
    try:
        cases = {
            "made-up": (OWNER, "s_madeupmadeupmadeup"),
            "closed": (OWNER, closed.session_id),
            "foreign": ("someone-else", mine.session_id),
            "empty": (OWNER, ""),
            "long": (OWNER, "s_" + "x" * 5000),
            "traversal": (OWNER, "../" + mine.session_id),
        }
        messages: dict[str, set[str]] = {}
        for label, (owner, session_id) in cases.items():
            calls = [
                service.run(owner, "print('pwned')", session_id=session_id),
                service.list_files(owner, session_id),
                service.read_file(owner, session_id, "x"),
                service.write_file(owner, session_id, "x", b"pwned"),
                service.close_session(owner, session_id),
            ]
            for call in calls:
                with pytest.raises(SessionNotFound) as caught:
                    await call
                text = str(caught.value)
                assert len(text) < 300
                messages.setdefault(label, set()).add(text.replace(repr(session_id[:100]), "<ID>"))
        shapes = set().union(*messages.values())
        assert len(shapes) == 1, messages  # no hint whether the session exists or whose it is
        assert "no such session" in shapes.pop()
        listed = await service.list_files(OWNER, mine.session_id)
        assert listed == ([], False)  # the foreign attempts wrote nothing
        await assert_answers(service, mine.session_id)
    finally:
        await service.close_session(OWNER, mine.session_id)


# -- 33. concurrent runs on one session ----------------------------------------------------------------------
async def test_concurrent_runs_on_one_session_get_a_busy_answer_and_never_interleave(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    await service.run(OWNER, "counter = 0", session_id=sid)
    results: dict[int, RunResult] = {}

    async def one(n: int) -> None:
        code = (
            "import time\n"
            "global counter\n"
            "mine = counter = counter + 1\n"
            f"for _ in range(20):\n"
            f"    print('run{n}', flush=True)\n"
            "    time.sleep(0.005)\n"
            "assert counter == mine  # nobody else ran in between\n"
            "mine"
        )
        try:
            results[n] = await service.run(OWNER, code, session_id=sid, timeout=60)
        except SessionBusy as exc:
            refused.append(str(exc))

    refused: list[str] = []
    try:
        with anyio.fail_after(90):
            async with anyio.create_task_group() as tg:
                for n in range(6):
                    tg.start_soon(one, n)
        # One runs; the others get a clear answer naming it (they never wait in line unseen).
        assert len(results) == 1 and len(refused) == 5, (results, refused)
        ((n, result),) = results.items()
        assert result.status == "ok", result
        assert result.stdout == f"run{n}\n" * 20, result  # never interleaved
        assert result.result == "1"
        assert all("is busy with run" in message and "get_run" in message for message in refused)
        await assert_answers(service, sid)
    finally:
        await service.close_session(OWNER, sid)


# -- 34. closing a session during a run ---------------------------------------------------------------------
async def test_closing_a_session_during_a_run_ends_it_cleanly_and_removes_everything(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    registered = service.sessions.get(sid, OWNER)
    assert registered.sandbox is not None and registered.volume is not None
    container_id, volume = registered.sandbox.container_id, registered.volume
    started = anyio.Event()

    async def on_output(stream: str, text: str) -> None:
        started.set()

    result: RunResult | None = None

    async def run() -> None:
        nonlocal result
        code = "import time\nprint('running', flush=True)\nwhile True: time.sleep(0.1)"
        result = await service.run(OWNER, code, session_id=sid, timeout=60, on_output=on_output)

    with anyio.fail_after(45):
        async with anyio.create_task_group() as tg:
            tg.start_soon(run)
            await started.wait()
            await service.close_session(OWNER, sid)
    assert result is not None
    assert result.status == "cancelled", result
    assert result.error is not None and "closed" in result.error.message
    await wait_until(lambda: not container_exists(container_id) and not volume_exists(volume), 30)
    with pytest.raises(SessionNotFound):
        await service.run(OWNER, "print(1)", session_id=sid)
    await assert_answers(service)


# -- 35. the server SIGKILLed mid-run ------------------------------------------------------------------------
KILLED_MID_RUN = """
import anyio
from mcp_code_exec.sandbox.ownership import owner_token
from mcp_code_exec.service.facade import SandboxService
from _support import make_test_config

async def main():
    async with SandboxService.start(make_test_config(pool={"size": 1, "session_spares": 0})) as s:
        await s.wait_ready()
        session = await s.new_session("x")
        started = anyio.Event()
        count = 0

        async def on_output(stream, text):
            nonlocal count
            count += 1
            if count == 2:
                started.set()

        code = "import os, time\\nif os.fork() == 0:\\n    os.setsid()\\n    time.sleep(1000)\\n"
        code += "print('running', flush=True)\\ntime.sleep(1000)"
        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: s.run("x", code, session_id=session.session_id, timeout=600, on_output=on_output))
            tg.start_soon(lambda: s.run("x", code, timeout=600, on_output=on_output))
            await started.wait()
            print(owner_token(), flush=True)
            await anyio.sleep_forever()

anyio.run(main)
"""


async def test_a_server_killed_mid_run_leaves_nothing_once_a_new_one_starts(service: SandboxService) -> None:
    async with crashing_server(KILLED_MID_RUN) as dead_owner:
        assert len(project_containers(dead_owner)) >= 2  # a session and a stateless container, both busy
        assert project_volumes(dead_owner)
    # The containers notice (stdin closes) and end; a new server's sweep removes whatever is left.
    async with SandboxService.start(make_test_config(pool={"size": 1, "session_spares": 0})) as fresh:
        await wait_until(lambda: not project_containers(dead_owner), 60)
        await wait_until(lambda: not project_volumes(dead_owner), 30)
        await fresh.wait_ready()
        assert (await fresh.run(OWNER, "print(1)")).stdout == "1\n"
    await assert_answers(service)


async def new_session_and_its_resources(service: SandboxService) -> tuple[str, str, str]:
    """A new session's id, with the container and volume that must be gone once it is reclaimed."""
    session = await service.new_session(OWNER)
    registered = service.sessions.get(session.session_id, OWNER)
    assert registered.sandbox is not None and registered.volume is not None
    return session.session_id, registered.sandbox.container_id, registered.volume


# -- 36. idle timeout and lifetime during a long run ---------------------------------------------------------
async def test_a_long_run_outlasts_the_idle_timeout_then_the_idle_session_is_reclaimed(config: object) -> None:
    settings = make_test_config(pool={"size": 1, "session_spares": 0}, sessions={"idle_timeout_s": 1.0})
    async with SandboxService.start(settings) as service:
        sid, container_id, volume = await new_session_and_its_resources(service)
        with anyio.fail_after(30):
            result = await service.run(
                OWNER, "import time; time.sleep(3); print('finished')", session_id=sid, timeout=20
            )
        # A session is not idle while it runs: the run completes, deterministically.
        assert result.status == "ok", result
        assert result.stdout == "finished\n"
        # Then it is idle, and reclaimed: container and volume removed, the id unknown.
        await wait_until(lambda: not container_exists(container_id) and not volume_exists(volume), 30)
        with pytest.raises(SessionNotFound):
            await service.run(OWNER, "print(1)", session_id=sid)


async def test_a_run_past_the_session_lifetime_is_cancelled_and_reclaimed() -> None:
    settings = make_test_config(pool={"size": 1, "session_spares": 0}, sessions={"max_lifetime_s": 3.0})
    async with SandboxService.start(settings) as service:
        sid, container_id, volume = await new_session_and_its_resources(service)
        with anyio.fail_after(30):
            result = await service.run(OWNER, "import time; time.sleep(60)", session_id=sid, timeout=50)
        assert result.status == "cancelled", result
        assert result.error is not None and "closed" in result.error.message
        await wait_until(lambda: not container_exists(container_id) and not volume_exists(volume), 30)
        with pytest.raises(SessionNotFound):
            await service.run(OWNER, "print(1)", session_id=sid)
