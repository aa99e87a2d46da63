"""What an attack on the quotas found (issue 36), on a test clock without an engine: a run's CPU
figure comes out of the sandbox (its supervisor's ``done`` frame), and a figure no run could have
used (beyond its wall time at the container's CPU limit) must not buy CPU the session's container
later burns. On the real engine: ``tests/engine/test_quota_attacks.py``."""

from __future__ import annotations

from types import SimpleNamespace
from typing import Any, cast

import pytest

from mcp_code_exec.config.accounting import AuditSettings, QuotaLimits, QuotaSettings
from mcp_code_exec.models import RunResult, Usage
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.service.accounting import Accounting
from mcp_code_exec.service.runs import Run
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
