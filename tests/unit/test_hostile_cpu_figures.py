"""What an attack on the quotas found (issue 36), without Docker: a run's CPU figure comes out of the
sandbox (its supervisor's ``done`` frame, which the security model calls hostile), so neither a
figure no run could have used nor one of nothing may decide what an identity is charged: what the
host counts of the container does. What else the attack found, on the real engine:
``tests/engine/test_quota_attacks.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest
from _fake_agent import FakeAgent
from mcpx_agent import events

from mcp_code_exec.config.accounting import AuditSettings, QuotaLimits, QuotaSettings
from mcp_code_exec.config.settings import load_config
from mcp_code_exec.errors import OverQuota
from mcp_code_exec.models import RunResult, Usage
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.runtime.memory import MemoryEngine
from mcp_code_exec.service.accounting import Accounting
from mcp_code_exec.service.facade import SandboxService
from mcp_code_exec.service.run_registry import Run
from mcp_code_exec.service.sessions import Session

pytestmark = pytest.mark.anyio
T0 = 1_749_999_600.0


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class Engine:
    """The container's CPU total as the engine's host counts it (what nothing in a sandbox can change)."""

    def __init__(self) -> None:
        self.total = 1.0

    async def cpu_usage_s(self, container_id: str) -> float:
        return self.total


async def test_a_cpu_figure_no_run_could_have_used_does_not_buy_what_its_container_burns_later() -> None:
    clock, engine = Clock(), Engine()
    accounting = Accounting(
        QuotaSettings(default=QuotaLimits(cpu_s_per_hour=100)), AuditSettings(), clock=clock, cpus=1.0
    )
    sandbox = SimpleNamespace(container_id="c1", alive=True, engine=engine)
    session = Session(id="s_attack", owner="token:mallory", volume="v", sandbox=cast(Any, sandbox))
    await accounting.settle(session)  # the container's first figure: where it starts
    # A one-second run whose done frame claims as much CPU as the frame lets through (under 1e15 s).
    claimed = wire.RunUsage(cpu_user_s=9e14, cpu_system_s=0.0)
    run = Run(id="r_attack", owner="token:mallory", session_id=session.id, timeout_s=60)
    run.finished_at = run.started + 1.0
    engine.total += 1.0
    await accounting.run_ended(run, RunResult(status="ok", usage=Usage(**claimed.model_dump())), session)
    clock.now += 3600 + 120  # the claimed charge leaves the hour's window
    engine.total += 1000.0  # a thread the session left burns 1000 CPU seconds between its runs
    await accounting.settle(session)
    used = {each.quota: each.used for each in await accounting.quotas.standing("token:mallory")}
    assert used["cpu_s_per_hour"] >= 999.0, used  # today: 0, the session burns free for as long as it lives


async def test_a_stateless_run_is_charged_what_its_container_used_whatever_its_sandbox_says() -> None:
    """A stateless run's container is never read by the host today: its charge is the supervisor's
    ``done`` frame alone, bytes out of a sandbox, which the security model calls hostile."""
    engine_box: list[MemoryEngine] = []

    async def cell(code: str, request: dict[str, Any]) -> dict[str, Any]:
        engine = engine_box[0]
        for container_id in engine.running:  # the run burns 50 CPU seconds, as the host counts them
            engine.cpu_s[container_id] = engine.cpu_s.get(container_id, 0.0) + 50.0
        return {"usage": events.run_usage(0.0, 0.0, None, 0, 0, 0)}  # and its sandbox says it used none

    overrides: dict[str, Any] = {
        "pool": {"size": 1, "session_spares": 0, "acquire_timeout_s": 5},
        "sessions": {"durable": False},
        "quotas": {"default": {"cpu_s_per_hour": 10}},
    }
    async with MemoryEngine(FakeAgent(cell=cell)) as engine:
        engine_box.append(engine)
        async with SandboxService.start(load_config(environ={}, overrides=overrides), engine=engine) as service:
            await service.wait_ready(10)
            assert (await service.run("token:mallory", "burn")).status == "ok"
            with pytest.raises(OverQuota):  # today: admitted, the identity charged 0 s for 50
                await service.run("token:mallory", "burn")


async def test_a_container_started_for_a_paused_session_is_charged_from_its_creation() -> None:
    """A paused session's next call starts a container for it (the agent, the libraries it loads:
    about a CPU second on the real engine): that start is its owner's, charged from nothing, or an
    identity with one session more than its live cap would have one paused and another resumed at
    each call, uncharged. (A warm spare's start, before it was anyone's, is not.)"""
    overrides: dict[str, Any] = {
        "pool": {"size": 1, "session_spares": 0, "acquire_timeout_s": 5},
        "sessions": {"durable": False},
        "quotas": {"default": {"cpu_s_per_hour": 1000}},
    }
    async with MemoryEngine(FakeAgent()) as engine:

        async def started(container_id: str) -> float:
            return 1.0  # each container's figure: what its start used, and nothing since

        engine.cpu_usage_s = started  # type: ignore[method-assign]
        async with SandboxService.start(load_config(environ={}, overrides=overrides), engine=engine) as service:
            await service.wait_ready(10)
            session_id = (await service.new_session("token:mallory")).session_id
            session = service.sessions.get(session_id, "token:mallory")
            assert (await service.run("token:mallory", "a", session_id=session_id)).status == "ok"
            assert session.usage.idle_cpu_s == 0.0  # its first container came warm: its start is not charged
            assert await service.keeper.pause(session)
            assert (await service.run("token:mallory", "b", session_id=session_id)).status == "ok"
            assert session.usage.idle_cpu_s == pytest.approx(1.0)  # today: 0, the new container's figure its start
