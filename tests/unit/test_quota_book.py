"""The quota book's arithmetic on a test clock: rolling windows, refusals that name the quota and
when it frees, counts that free when their window passes, a bounded memory, and a store that
gives the counts back. The service and the real engine: ``tests/engine/test_quotas.py``."""

from __future__ import annotations

import anyio
import pytest

from mcp_code_exec.config.accounting import QuotaLimits, QuotaOverride, QuotaSettings
from mcp_code_exec.errors import EngineError, OverQuota
from mcp_code_exec.ledger.quotas import QuotaBook, when
from mcp_code_exec.ledger.windows import Window
from mcp_code_exec.observability import metrics
from mcp_code_exec.observability.logs import identity_hash

pytestmark = pytest.mark.anyio
T0 = 1_749_999_600.0  # a multiple of every step: each window's steps begin here


class Clock:
    def __init__(self) -> None:
        self.now = T0

    def __call__(self) -> float:
        return self.now


class MemoryStore:
    """A store that keeps the last state per identity hash (as the engine's ledgers do)."""

    def __init__(self) -> None:
        self.states: dict[str, str] = {}
        self.loads = 0

    async def load(self, key: str) -> list[str]:
        self.loads += 1
        return [self.states[key]] if key in self.states else []

    async def save(self, key: str, state: str) -> None:
        if state:
            self.states[key] = state
        else:
            self.states.pop(key, None)


def book(clock: Clock, store: MemoryStore | None = None, **limits: float) -> QuotaBook:
    return QuotaBook(QuotaSettings(default=QuotaLimits(**limits)), clock=clock, store=store)


def refusals(quota: str) -> float:
    return float(metrics.QUOTA_REFUSALS.labels(quota=quota)._value.get())


def test_a_charge_counts_at_least_its_window_and_at_most_one_step_more() -> None:
    window = Window(60, 5)
    window.add(T0 + 3, 1)
    assert window.total(T0 + 64) == 1  # 61 s after the charge: its step (T0..T0+5) ends at T0+5+60
    assert window.frees_at(T0 + 64, 1) == T0 + 65
    assert window.total(T0 + 65) == 0


def test_a_clock_set_back_neither_frees_usage_nor_holds_it_past_a_window() -> None:
    window = Window(60, 5)
    window.add(T0 + 3000, 7)  # the clock was ahead
    assert window.total(T0) == 7  # set back: the charge still counts, as now's
    assert window.total(T0 + 64) == 7 and window.total(T0 + 65) == 0


def test_a_stored_window_that_is_not_one_adds_nothing() -> None:
    window = Window(60, 5)
    for forged in ("1:nan", "x:1", "3:-5", "1:1e400", "9" * 30 + ":1"):
        window.decode(forged)
    assert window.empty
    window.decode(Window(60, 5, {int(T0 // 5): 2}).encode())
    assert window.total(T0) == 2


async def test_runs_past_the_minute_quota_are_refused_with_the_quota_its_window_and_when_it_frees() -> None:
    clock = Clock()
    quotas = book(clock, runs_per_minute=3)
    before = refusals("runs_per_minute")
    for second in (0, 10, 20):
        clock.now = T0 + second
        await quotas.admit_run("token:alice")
    clock.now = T0 + 30
    with pytest.raises(OverQuota) as refused:
        await quotas.admit_run("token:alice")
    said = str(refused.value)
    assert said.startswith("quota runs_per_minute reached: your identity started 3 runs in the last 60 s")
    assert "its quota is 3; a run can start again in 35 s (at 2025-06-15 15:01:05 UTC). Nothing was run" in said
    assert (refused.value.quota, refused.value.window_s, refused.value.frees_at) == ("runs_per_minute", 60.0, T0 + 65)
    assert refusals("runs_per_minute") == before + 1
    await quotas.admit_run("token:bob")  # another identity counts apart
    clock.now = T0 + 65  # the first run's step has left the window
    await quotas.admit_run("token:alice")
    with pytest.raises(OverQuota):
        await quotas.admit_run("token:alice")


async def test_cpu_seconds_past_the_hour_or_day_quota_refuse_the_next_run_until_they_leave_the_window() -> None:
    clock = Clock()
    quotas = book(clock, cpu_s_per_hour=10, cpu_s_per_day=15)
    await quotas.admit_run("local")
    await quotas.charge_cpu("local", 12.5)  # the run went past the quota: charged all the same
    with pytest.raises(OverQuota, match=r"used 12\.5 CPU seconds in the last hour, its quota is 10; runs are admitted "
                       r"again in 61 min") as refused:  # fmt: skip
        await quotas.admit_run("local")
    assert refused.value.quota == "cpu_s_per_hour"
    clock.now = T0 + 3660  # out of the hour, still in the day
    await quotas.admit_run("local")
    await quotas.charge_cpu("local", 3)
    with pytest.raises(OverQuota, match=r"used 15\.5 CPU seconds in the last 24 hours, its quota is 15") as refused:
        await quotas.admit_run("local")
    assert refused.value.quota == "cpu_s_per_day" and refused.value.frees_at == T0 + 86400 + 900
    clock.now = T0 + 86400 + 900
    await quotas.admit_run("local")


async def test_an_install_is_counted_whole_or_refused_whole() -> None:
    clock = Clock()
    quotas = book(clock, package_installs_per_day=5)
    await quotas.admit_installs("local", 3)
    with pytest.raises(OverQuota, match="brings 3 packages and your identity installed 3 in the last 24 hours, of a "
                       "quota of 5; it fits again in 24 h 15 min"):  # fmt: skip
        await quotas.admit_installs("local", 3)
    await quotas.admit_installs("local", 2)  # what fits still goes in
    with pytest.raises(OverQuota, match="ask for fewer packages") as refused:
        await quotas.admit_installs("local", 6)
    assert refused.value.frees_at is None


async def test_an_identitys_own_quotas_replace_the_defaults_and_a_group_entry_covers_its_members() -> None:
    settings = QuotaSettings(
        default=QuotaLimits(runs_per_minute=1),
        identities={"ci": QuotaOverride(runs_per_minute=0), "local": QuotaOverride(runs_per_minute=2)},
    )
    quotas = QuotaBook(settings, clock=Clock())
    for _ in range(5):
        await quotas.admit_run("token:ci")  # 0: no limit for the token named ci
    await quotas.admit_run("user:alice")
    await quotas.admit_run("user:alice")  # every stdio identity has the "local" entry's 2
    with pytest.raises(OverQuota):
        await quotas.admit_run("user:alice")
    await quotas.admit_run("token:other")
    with pytest.raises(OverQuota):
        await quotas.admit_run("token:other")
    assert settings.limits_for("token:ci").stored_mb == 16384  # what the entry leaves out is the default's


async def test_two_calls_racing_for_the_last_run_of_a_quota_cannot_both_pass() -> None:
    quotas = book(Clock(), MemoryStore(), runs_per_minute=5)
    passed = []

    async def one() -> None:
        try:
            await quotas.admit_run("token:racer")
            passed.append(1)
        except OverQuota:
            pass

    async with anyio.create_task_group() as tg:
        for _ in range(20):
            tg.start_soon(one)
    assert len(passed) == 5


async def test_memory_holds_a_bounded_number_of_identities_and_one_that_left_comes_back_with_its_counts() -> None:
    clock, store = Clock(), MemoryStore()
    quotas = QuotaBook(QuotaSettings(default=QuotaLimits(runs_per_minute=2)), clock=clock, store=store, max_tallies=10)
    await quotas.admit_run("token:first")
    await quotas.admit_run("token:first")
    for n in range(1000):
        await quotas.admit_run(f"token:user{n}")
        assert len(quotas) <= 10
    assert identity_hash("token:first") in store.states  # saved before it left memory
    with pytest.raises(OverQuota):  # and read again: its two runs still count
        await quotas.admit_run("token:first")


async def test_the_counts_outlive_the_book_through_its_store() -> None:
    clock, store = Clock(), MemoryStore()
    first = book(clock, store, runs_per_minute=2, cpu_s_per_hour=5)
    await first.admit_run("token:alice")
    await first.charge_cpu("token:alice", 6)
    assert await first.save() == 1 and await first.save() == 0  # saved once: nothing changed since
    second = book(clock, store, runs_per_minute=2, cpu_s_per_hour=5)  # a restarted server
    with pytest.raises(OverQuota, match="cpu_s_per_hour"):
        await second.admit_run("token:alice")
    clock.now = T0 + 3660 + 60
    await second.admit_run("token:alice")
    standing = {s.quota: s for s in await second.standing("token:alice")}
    assert standing["cpu_s_per_day"].used == 6 and standing["runs_per_minute"].used == 1
    assert standing["cpu_s_per_hour"].used == 0 and standing["cpu_s_per_hour"].frees_in_s is None


async def test_identities_without_a_counted_quota_cost_nothing() -> None:
    store = MemoryStore()
    quotas = book(Clock(), store)  # every counted quota 0
    for n in range(100):
        await quotas.admit_run(f"token:{n}")
        await quotas.charge_cpu(f"token:{n}", 100)
    assert len(quotas) == 0 and store.loads == 0 and await quotas.standing("token:1") == []


def test_a_wait_reads_in_seconds_minutes_or_hours_and_names_the_time() -> None:
    assert when(T0 + 42, T0) == "in 42 s (at 2025-06-15 15:00:42 UTC)"
    assert when(T0 + 600, T0).startswith("in 10 min")
    assert when(T0 + 3 * 3600 + 300, T0).startswith("in 3 h 5 min")


async def test_a_run_whose_sandbox_gave_no_cpu_figure_is_charged_the_most_it_could_have_used() -> None:
    """A run that fills its memory until the supervisor stops answering ends ``crashed`` with no
    figures: charged nothing, it would be a free way past the CPU quotas."""
    from mcp_code_exec.config.accounting import AuditSettings
    from mcp_code_exec.models import RunResult, Usage
    from mcp_code_exec.service.accounting import Accounting
    from mcp_code_exec.service.run_registry import Run

    clock = Clock()
    settings = QuotaSettings(default=QuotaLimits(cpu_s_per_hour=100))
    accounting = Accounting(settings, AuditSettings(), clock=clock, cpus=2.0)
    lost = Run(id="r_lost", owner="local", session_id=None, timeout_s=60)
    lost.started, lost.finished_at = 0.0, 40.0  # 40 s of wall time, at 2 CPUs at most
    await accounting.run_ended(lost, RunResult(status="crashed"))
    measured = Run(id="r_measured", owner="local", session_id=None, timeout_s=60)
    measured.started, measured.finished_at = 0.0, 40.0
    await accounting.run_ended(measured, RunResult(status="ok", usage=Usage(cpu_user_s=1.5, cpu_system_s=0.5)))
    standing = {each.quota: each.used for each in await accounting.quotas.standing("local")}
    assert standing["cpu_s_per_hour"] == 82.0  # 80 for the run without figures, 2 for the measured one


class FailingStore(MemoryStore):
    """A store whose engine stops answering: what leaves memory cannot be kept."""

    async def save(self, key: str, state: str) -> None:
        raise EngineError("the engine is away")


async def test_a_charge_the_engine_fails_to_make_room_for_is_logged_by_hash_and_the_run_still_ends(
    caplog: pytest.LogCaptureFixture,
) -> None:
    """Charging a run's CPU may need room in memory, made by keeping another identity's counts on the
    engine: an engine error there must not take the run's answer with it."""
    from mcp_code_exec.config.accounting import AuditSettings
    from mcp_code_exec.models import RunResult, Usage
    from mcp_code_exec.service.accounting import Accounting
    from mcp_code_exec.service.run_registry import Run

    clock = Clock()
    accounting = Accounting(
        QuotaSettings(default=QuotaLimits(cpu_s_per_hour=100)), AuditSettings(), FailingStore(), clock
    )
    accounting.quotas.max_tallies = 1
    await accounting.quotas.charge_cpu("token:first", 1.0)  # in memory, changed: it must be kept to leave
    run = Run(id="r_one", owner="token:second", session_id=None, timeout_s=60)
    run.finished_at = run.started + 1.0
    usage = await accounting.run_ended(run, RunResult(status="ok", usage=Usage(cpu_user_s=0.5, cpu_system_s=0.1)))
    assert usage.cpu_s == 0.6  # the run's usage is there all the same
    dropped = [r.getMessage() for r in caplog.records if "CPU charge" in r.getMessage()]
    assert dropped and identity_hash("token:second") in dropped[0] and "token:second" not in dropped[0], dropped


class HangingStore(MemoryStore):
    async def load(self, key: str) -> list[str]:
        await anyio.sleep_forever()
        raise AssertionError


async def test_a_charge_that_cannot_be_made_in_time_is_logged_by_hash(
    caplog: pytest.LogCaptureFixture, monkeypatch: pytest.MonkeyPatch
) -> None:
    from mcp_code_exec.config.accounting import AuditSettings
    from mcp_code_exec.service import accounting as module

    monkeypatch.setattr(module, "CHARGE_WAIT_S", 0.05)
    accounting = module.Accounting(
        QuotaSettings(default=QuotaLimits(cpu_s_per_hour=100)), AuditSettings(), HangingStore()
    )
    assert not await accounting.charge("user:alice", 2.5, "run")
    dropped = [r.getMessage() for r in caplog.records if "CPU charge" in r.getMessage()]
    assert dropped == [
        f"a run CPU charge of 2.500 s to identity {identity_hash('user:alice')} was dropped: TimeoutError"
    ]
