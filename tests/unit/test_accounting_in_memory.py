"""Usage, quotas and the audit log through the service, over the in-memory engine: a refused run
is never started and never recorded as one, a run that could not start is taken back, the counts
go on the engine at the service's end and come back at the next start, every run and call has its
line. The real engine: ``tests/engine/test_quotas.py``, ``test_audit.py``, ``test_usage.py``."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import anyio
import pytest
from _fake_agent import FakeAgent

from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.errors import OverQuota, SessionBusy
from mcp_code_exec.ledger.chain import verify
from mcp_code_exec.runtime.base import LABEL_KIND
from mcp_code_exec.runtime.memory import MemoryEngine
from mcp_code_exec.sandbox.ownership import LEDGER_KIND
from mcp_code_exec.service import accounting
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


def settings(log: Path, runs_per_minute: int = 2) -> Config:
    overrides: dict[str, Any] = {
        "pool": {"size": 1, "session_spares": 0, "acquire_timeout_s": 5},
        "sessions": {"durable": False},
        "quotas": {"default": {"runs_per_minute": runs_per_minute}},
        "audit": {"path": str(log)},
    }
    return load_config(environ={}, overrides=overrides)


async def test_runs_count_against_the_quota_across_a_restart_and_each_has_its_audit_line(tmp_path: Path) -> None:
    log = tmp_path / "audit.log"
    clock = [1_749_999_600.0]
    async with MemoryEngine(FakeAgent()) as engine:
        async with SandboxService.start(settings(log), engine=engine, clock=lambda: clock[0]) as service:
            await service.wait_ready(10)
            first = await service.run("me", "1")
            assert first.usage is not None and first.usage.wall_s is not None and first.usage.cpu_user_s is None
        ledgers = [labels for labels in engine.volume_labels.values() if labels.get(LABEL_KIND) == LEDGER_KIND]
        assert len(ledgers) == 2  # the counts and the audit log's last line, kept for the next server
        async with SandboxService.start(settings(log), engine=engine, clock=lambda: clock[0]) as service:
            await service.wait_ready(10)
            await service.run("me", "2")
            with pytest.raises(OverQuota, match="started 2 runs in the last 60 s"):
                await service.run("me", "3")
            clock[0] += 65
            await service.run("me", "4")
    lines = [json.loads(line) for line in log.read_text().splitlines()]
    assert [line["event"] for line in lines if line["event"] in ("run", "server")] == [
        "server", "run", "server", "server", "run", "run", "server",
    ]  # fmt: skip
    assert verify([log], None).intact


async def test_a_run_refused_by_a_busy_session_is_taken_back_from_the_quota(tmp_path: Path) -> None:
    gate = anyio.Event()

    async def cell(code: str, request: dict[str, Any]) -> dict[str, Any]:
        if code == "wait":
            await gate.wait()
        return {"stdout": ""}

    async with MemoryEngine(FakeAgent(cell=cell)) as engine:
        async with SandboxService.start(settings(tmp_path / "a.log", 3), engine=engine) as service:
            await service.wait_ready(10)
            session_id = (await service.new_session("me")).session_id
            waiting = await service.start_run("me", "wait", session_id=session_id)
            for _ in range(3):
                with pytest.raises(SessionBusy):
                    await service.start_run("me", "1", session_id=session_id)
            gate.set()
            await waiting.finished.wait()
            await service.run("me", "2", session_id=session_id)  # the busy refusals counted nothing
            await service.run("me", "3")
            report = await service.usage("me", session_id)
            assert report.session is not None and report.session.runs == 2
            assert {q.quota: q.used for q in report.quotas}["runs_per_minute"] == 3
            with pytest.raises(OverQuota):
                await service.run("me", "4")
            await service.close_session("me", session_id)
        for name, labels in list(engine.volume_labels.items()):
            if labels.get(LABEL_KIND) == LEDGER_KIND:
                await engine.remove_volume(name)


async def test_a_sessions_cpu_outside_its_runs_is_charged_once_from_its_containers_total(tmp_path: Path) -> None:
    """The engine's figure for the container (here set by the test) less what its runs were charged:
    its first figure is where it starts, each settlement charges what was not charged, the last one
    comes as it closes, and each has its audit line."""
    log = tmp_path / "audit.log"

    async def cell(code: str, request: dict[str, Any]) -> dict[str, Any]:
        # 0.25 s: a run of no wall time could not use more (``accounting.CPU_SLACK_S``)
        return {"usage": {"cpu_user_s": 0.25, "cpu_system_s": 0.0, "peak_memory_bytes": None,
                          "data_written_bytes": 0, "packages_installed": 0, "tool_calls": 0}}  # fmt: skip

    overrides: dict[str, Any] = {
        "pool": {"size": 1, "session_spares": 0, "acquire_timeout_s": 5},
        "sessions": {"durable": False},
        "quotas": {"default": {"cpu_s_per_hour": 1000}},
        "audit": {"path": str(log)},
    }
    config = load_config(environ={}, overrides=overrides)
    async with MemoryEngine(FakeAgent(cell=cell)) as engine, SandboxService.start(config, engine=engine) as service:
        await service.wait_ready(10)

        async def used() -> float:
            return next(q.used for q in await service.accounting.quotas.standing("me") if q.quota == "cpu_s_per_hour")

        session_id = (await service.new_session("me")).session_id
        session = service.sessions.get(session_id, "me")
        assert session.sandbox is not None
        container = session.sandbox.container_id
        engine.cpu_s[container] = 0.5  # its start: the server's, before any code ran in it
        await service.run("me", "a", session_id=session_id)
        assert await used() == 0.25
        engine.cpu_s[container] = 0.5 + 0.25 + 3.0  # 3 s burnt after the run
        await service.run("me", "b", session_id=session_id)
        assert await used() == 0.25 + 3.0 + 0.25 and session.usage.idle_cpu_s == 3.0
        engine.cpu_s[container] = 0.5 + 3.5  # the run's CPU, as its container's figure shows it
        await service.accounting.settle(session)  # nothing more used: nothing charged twice
        assert await used() == 3.5
        engine.cpu_s[container] = 0.5 + 3.5 + 2.0
        session.busy += 1  # a call came while the timer read it: that figure may hold a run's CPU
        await service.accounting.settle(session, unused=True)
        session.busy -= 1
        assert await used() == 3.5
        await service.close_session("me", session_id)
        assert await used() == 5.5
    idle = [json.loads(line) for line in log.read_text().splitlines() if '"idle_cpu"' in line]
    assert [(line["cpu_s"], line["read"]) for line in idle] == [(3.0, "idle"), (2.0, "idle")]
    assert verify([log], None).intact


async def test_a_container_that_died_between_runs_is_charged_the_most_it_could_have_used_unread(
    tmp_path: Path,
) -> None:
    """Killing its own container between runs must not make what it burnt since the last figure free:
    with no figure left to read, that span (at most ``SETTLE_S``) is charged at the CPU limit."""
    from mcp_code_exec.service.accounting import SETTLE_S

    overrides: dict[str, Any] = {
        "pool": {"size": 1, "session_spares": 0, "acquire_timeout_s": 5},
        "sessions": {"durable": False},
        "quotas": {"default": {"cpu_s_per_hour": 1000}},
        "limits": {"cpus": 2.0},
    }
    config = load_config(environ={}, overrides=overrides)
    async with MemoryEngine(FakeAgent()) as engine, SandboxService.start(config, engine=engine) as service:
        await service.wait_ready(10)
        session_id = (await service.new_session("me")).session_id
        session = service.sessions.get(session_id, "me")
        assert session.sandbox is not None
        engine.cpu_s[session.sandbox.container_id] = 0.5
        await service.accounting.settle(session)  # its first figure
        session.cpu_read_at -= 3600  # read an hour ago (a test's clock, not a sleep)
        await session.sandbox.destroy()  # gone: nothing to read
        await service.run("me", "1", session_id=session_id)
        standing = await service.accounting.quotas.standing("me")
        used = next(q.used for q in standing if q.quota == "cpu_s_per_hour")
        assert used >= SETTLE_S * 2.0  # the most it could have burnt unread, and not the hour
        assert used < SETTLE_S * 2.0 + 60


async def test_a_container_never_read_is_charged_the_span_it_lived_at_most_when_it_goes(tmp_path: Path) -> None:
    """No figure ever came for it (the engine did not answer): as it goes it is charged its unread span at
    the CPU limit, counted from when it came to the session, not the whole bound."""
    overrides: dict[str, Any] = {
        "pool": {"size": 1, "session_spares": 0, "acquire_timeout_s": 5},
        "sessions": {"durable": False},
        "quotas": {"default": {"cpu_s_per_hour": 1000}},
    }
    config = load_config(environ={}, overrides=overrides)
    async with MemoryEngine(FakeAgent()) as engine, SandboxService.start(config, engine=engine) as service:
        await service.wait_ready(10)
        session_id = (await service.new_session("me")).session_id
        session = service.sessions.get(session_id, "me")
        assert session.sandbox is not None and session.sandbox.container_id not in engine.cpu_s
        session.cpu_read_at -= 3.0  # came 3 s ago (a test's clock, not a sleep)
        await session.sandbox.destroy()  # gone, never read
        await service.run("me", "1", session_id=session_id)
        standing = await service.accounting.quotas.standing("me")
        used = next(q.used for q in standing if q.quota == "cpu_s_per_hour")
        assert 3.0 <= used < 5.0


async def test_every_sessions_cpu_between_runs_is_read_by_the_timer_and_at_its_end_but_before_calls_only_with_a_quota(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """``get_usage`` and ``mcp-code-exec usage`` show what a session burnt between its runs whatever its
    identity's quotas; the reading before each call, which the call waits for, only where a CPU quota counts."""
    monkeypatch.setattr(accounting, "SETTLE_S", 3600.0)  # the test settles as the timer would, when it says
    overrides: dict[str, Any] = {"pool": {"size": 1, "session_spares": 0, "acquire_timeout_s": 5}}
    config = load_config(environ={}, overrides={**overrides, "sessions": {"durable": False}})
    async with MemoryEngine(FakeAgent()) as engine, SandboxService.start(config, engine=engine) as service:
        await service.wait_ready(10)
        reads: list[str] = []
        read = engine.cpu_usage_s

        async def counted(container_id: str) -> float | None:
            reads.append(container_id)
            return await read(container_id)

        engine.cpu_usage_s = counted  # type: ignore[method-assign]
        session_id = (await service.new_session("me")).session_id
        session = service.sessions.get(session_id, "me")
        assert session.sandbox is not None
        container = session.sandbox.container_id
        engine.cpu_s[container] = 0.5
        await service.run("me", "a", session_id=session_id)
        await service.run("me", "b", session_id=session_id)
        assert reads == []  # no quota: the calls did not wait for a reading
        await service.accounting.settle(session, unused=True)  # the timer's: never read, all of it counts
        first = session.usage.idle_cpu_s
        assert first == pytest.approx(0.5, abs=0.01)
        engine.cpu_s[container] = 0.5 + 3.0
        await service.accounting.settle(session, unused=True)
        assert session.usage.idle_cpu_s == pytest.approx(first + 3.0)
        engine.cpu_s[container] = 0.5 + 3.0 + 2.0
        await service.close_session("me", session_id)
        assert session.usage.idle_cpu_s == pytest.approx(first + 5.0) and len(reads) == 3


async def test_audit_lines_cut_from_the_end_while_no_server_ran_are_found_at_the_next_start(tmp_path: Path) -> None:
    """The log's last line is kept on the engine, away from the file: a file cut back to a whole line
    (which verifies on its own) is found at the next start, and ``audit verify`` reports it."""
    log = tmp_path / "audit.log"
    config = load_config(environ={}, overrides={"pool": {"size": 1, "session_spares": 0}, "audit": {"path": str(log)}})
    async with MemoryEngine(FakeAgent()) as engine:
        async with SandboxService.start(config, engine=engine) as service:
            await service.wait_ready(10)
            await service.run("me", "1")
            await service.run("me", "2")
        whole = log.read_bytes().splitlines(keepends=True)
        log.write_bytes(b"".join(whole[:-3]))  # the last run and the server's stop gone
        assert verify([log], None).intact
        async with SandboxService.start(config, engine=engine) as service:
            await service.wait_ready(10)
    found = verify([log], None)
    assert len(found.breaks) == 1 and "lines were cut from the end of the log" in found.breaks[0].what, found
