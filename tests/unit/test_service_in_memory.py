"""The service's bookkeeping over the in-memory engine: pool reuse and growth, sessions, runs, limits."""

from __future__ import annotations

import logging
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from _fake_agent import FakeAgent

from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.errors import ClientLimit, EngineError, RunNotFound, SessionBusy, SessionLimit
from mcp_code_exec.runtime.base import ContainerSpec
from mcp_code_exec.runtime.memory import MemoryEngine
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


def settings(**sections: dict[str, Any]) -> Config:
    """Sessions end with the service (not durable), so the leak check below covers them too."""
    base: dict[str, Any] = {
        "pool": {"size": 1, "session_spares": 0, "acquire_timeout_s": 5},
        "sessions": {"durable": False},
    }
    for key, value in sections.items():
        base[key] = {**base.get(key, {}), **value}
    return load_config(environ={}, overrides=base)


@asynccontextmanager
async def running(agent: FakeAgent, config: Config) -> AsyncIterator[tuple[SandboxService, MemoryEngine]]:
    with anyio.fail_after(30):
        async with MemoryEngine(agent) as engine, SandboxService.start(config, engine=engine) as service:
            await service.wait_ready(10)
            yield service, engine
        assert engine.running == {} and engine.volume_labels == {}  # nothing left behind


def waiting_cell(gate: anyio.Event) -> Any:
    async def cell(code: str, request: dict[str, Any]) -> dict[str, Any]:
        if code == "wait":
            await gate.wait()
        return {"stdout": f"ran {code}\n"}

    return cell


async def test_a_stateless_container_is_reused_once_its_agent_says_it_is_clean() -> None:
    async with running(FakeAgent(), settings()) as (service, engine):
        first = await service.run("me", "1")
        second = await service.run("me", "2")
        assert (first.stdout, second.stdout) == ("ran 1\n", "ran 2\n")
        assert engine.started == 1


async def test_a_container_that_is_not_clean_after_a_run_is_never_reused() -> None:
    async with running(FakeAgent(clean=False), settings()) as (service, engine):
        for code in ("1", "2", "3"):
            assert (await service.run("me", code)).status == "ok"
        assert engine.started >= 3  # each run in a fresh container


async def test_a_call_that_waited_gets_a_container_started_and_the_extra_one_is_retired() -> None:
    gate = anyio.Event()
    config = settings(pool={"max_size": 3, "grow_after_s": 0.1})
    async with running(FakeAgent(cell=waiting_cell(gate)), config) as (service, engine):
        held = await service.start_run("alice", "wait")
        assert (await service.run("bob", "quick")).stdout == "ran quick\n"  # served by a new container
        assert engine.started == 2
        gate.set()
        await held.finished.wait()
        await service.stateless_pool.wait_for(lambda pool: pool.owned == 1, 5)  # the extra one is retired


async def test_one_client_waits_its_turn_past_its_run_limit_and_then_hears_why() -> None:
    gate = anyio.Event()
    config = settings(pool={"size": 2, "max_runs_per_client": 1, "acquire_timeout_s": 0.5})
    async with running(FakeAgent(cell=waiting_cell(gate)), config) as (service, _):
        await service.start_run("alice", "wait")
        with pytest.raises(ClientLimit, match="your limit of 1 runs at once"):
            await service.start_run("alice", "again")
        assert (await service.run("bob", "1")).status == "ok"
        gate.set()


async def test_a_client_has_its_own_share_of_sessions() -> None:
    config = settings(sessions={"max_sessions": 4, "max_per_client": 2})
    async with running(FakeAgent(), config) as (service, _):
        mine = [await service.new_session("alice") for _ in range(2)]
        with pytest.raises(SessionLimit, match="your limit of 2 open sessions"):
            await service.new_session("alice")
        theirs = await service.new_session("bob")
        for info, owner in [*((m, "alice") for m in mine), (theirs, "bob")]:
            await service.close_session(owner, info.session_id)


async def test_a_busy_session_answers_every_other_call_with_the_run_it_is_busy_with() -> None:
    gate = anyio.Event()
    async with running(FakeAgent(cell=waiting_cell(gate)), settings()) as (service, _):
        sid = (await service.new_session("me")).session_id
        run = await service.start_run("me", "wait", session_id=sid)
        for attempt in (
            service.start_run("me", "1", session_id=sid),
            service.list_files("me", sid),
            service.write_file("me", sid, "a", b"x"),
        ):
            with pytest.raises(SessionBusy, match=f"busy with run '{run.id}'"):
                await attempt
        gate.set()
        await run.finished.wait()
        assert (await service.run("me", "after", session_id=sid)).stdout == "ran after\n"
        await service.close_session("me", sid)


async def test_a_stream_with_a_bounded_wait_is_told_busy_while_another_transfer_holds_its_session() -> None:
    async with running(FakeAgent(), settings()) as (service, _):
        sid = (await service.new_session("me")).session_id
        await service.write_file("me", sid, "a", b"x")
        holding, done = anyio.Event(), anyio.Event()

        async def transfer() -> None:
            async with service.read_stream("me", sid, "a"):
                holding.set()
                await done.wait()

        async with anyio.create_task_group() as tg:
            tg.start_soon(transfer)
            await holding.wait()
            for wait_s in (0, 0.05):
                with pytest.raises(SessionBusy, match="busy with another file transfer"):
                    async with service.read_stream("me", sid, "a", busy_wait_s=wait_s):
                        pass
            done.set()
        async with service.read_stream("me", sid, "a", busy_wait_s=0) as found:  # free again
            assert found.size == 1
        await service.close_session("me", sid)


async def test_a_cancelled_run_ends_as_cancelled_and_frees_its_session() -> None:
    gate = anyio.Event()
    async with running(FakeAgent(cell=waiting_cell(gate)), settings()) as (service, _):
        sid = (await service.new_session("me")).session_id
        run = await service.start_run("me", "wait", session_id=sid)
        await service.cancel_and_wait(run)
        assert run.result is not None and run.result.status == "cancelled"
        assert (await service.run("me", "next", session_id=sid)).status == "ok"
        await service.close_session("me", sid)


async def test_a_run_cancelled_after_its_session_lost_its_container_still_says_the_session_restarted() -> None:
    gate = anyio.Event()
    async with running(FakeAgent(cell=waiting_cell(gate)), settings()) as (service, _):
        sid = (await service.new_session("me")).session_id
        assert not (await service.run("me", "x = 1", session_id=sid)).session_restarted
        service.sessions.get(sid, "me").mark_variables_gone()  # as a container lost between runs leaves it
        run = await service.start_run("me", "wait", session_id=sid)
        await service.cancel_and_wait(run)
        assert run.result is not None and run.result.status == "cancelled" and run.result.session_restarted
        await service.close_session("me", sid)


async def test_a_run_that_fails_in_the_service_after_its_session_lost_its_container_still_says_so() -> None:
    async with running(FakeAgent(), settings()) as (service, _):
        sid = (await service.new_session("me")).session_id
        assert not (await service.run("me", "x = 1", session_id=sid)).session_restarted
        service.sessions.get(sid, "me").mark_variables_gone()  # as a container lost between runs leaves it

        async def broken_prepare(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("a fault of the service's own")

        prepare = service.executor.packages.prepare
        service.executor.packages.prepare = broken_prepare  # type: ignore[method-assign]
        try:
            result = await service.run("me", "y = 1", session_id=sid)
        finally:
            service.executor.packages.prepare = prepare  # type: ignore[method-assign]
        assert result.status == "crashed" and result.session_restarted, result
        assert not (await service.run("me", "z = 1", session_id=sid)).session_restarted  # told once
        await service.close_session("me", sid)


async def test_runs_belong_to_their_owner() -> None:
    async with running(FakeAgent(), settings()) as (service, _):
        run = await service.start_run("alice", "1")
        await run.finished.wait()
        assert service.get_run("alice", run.id) is run
        with pytest.raises(RunNotFound):
            service.get_run("bob", run.id)


async def test_stopping_the_service_cancels_runs_still_going() -> None:
    gate = anyio.Event()
    async with running(FakeAgent(cell=waiting_cell(gate)), settings()) as (service, _):
        run = await service.start_run("me", "wait")
    assert run.result is not None and run.result.status == "cancelled"


class OneStartFails(MemoryEngine):
    """The first container start fails at once; the next succeeds only after it (one batch)."""

    def __init__(self) -> None:
        super().__init__(FakeAgent())
        self.first_failed = anyio.Event()
        self.calls = 0

    async def start(self, spec: ContainerSpec) -> tuple[str, Any]:
        self.calls += 1
        if self.calls == 1:
            self.first_failed.set()
            raise EngineError("the Docker engine refused: no space left on device")
        await self.first_failed.wait()
        return await super().start(spec)


async def test_a_failed_start_beside_a_good_one_still_logs_its_reason(caplog: pytest.LogCaptureFixture) -> None:
    config = settings(pool={"size": 2})
    with caplog.at_level(logging.WARNING, logger="mcp_code_exec.sandbox.pool"), anyio.fail_after(30):
        async with OneStartFails() as engine, SandboxService.start(config, engine=engine) as service:
            await service.wait_ready(10)
            assert (await service.run("me", "1")).status == "ok"
    failures = [r.getMessage() for r in caplog.records if "container start failed" in r.getMessage()]
    assert failures and all("no space left on device" in line for line in failures), failures
