"""Quotas per identity on the real engine, on a test clock (never a sleep): each refuses past its
limit with the documented message (the quota, what was counted, its window, when it frees) and frees
when its window passes; they hold across a restart of the server and across forks, and calls racing
over several sessions cannot pass one. docs/accounting.md#quotas."""

from __future__ import annotations

import subprocess
import time
from collections.abc import AsyncIterator, Iterator
from contextlib import asynccontextmanager
from typing import Any

import anyio
import pytest
from _host_pip import LoopbackIndex, loopback_index
from _security import runsc_available, runsc_leftovers
from _support import existing_volumes, make_test_config, project_containers, wait_until

from mcp_code_exec.errors import OverQuota
from mcp_code_exec.observability import metrics
from mcp_code_exec.sandbox.ledgers import LABEL_HOLDER
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
BURN = "import time\nend = time.process_time() + {s}\nwhile time.process_time() < end:\n    for _ in range(100_000):\n        pass\n"
QUOTAS = {
    "token:runs": {"runs_per_minute": 3},
    "token:cpu": {"cpu_s_per_hour": 0.5, "cpu_s_per_day": 0.55},
    "token:installs": {"package_installs_per_day": 1},
    "token:disk": {"stored_mb": 64},
    "token:racer": {"runs_per_minute": 5},
    "token:forker": {"cpu_s_per_hour": 0.5, "runs_per_minute": 100},
    "token:idler": {"cpu_s_per_hour": 3600},
    "token:burner": {"cpu_s_per_hour": 2},
}

RUNTIMES = [
    pytest.param("runc", id="runc"),
    pytest.param(
        "runsc", id="runsc", marks=[pytest.mark.runsc, pytest.mark.skipif(not runsc_available(), reason="no gVisor")]
    ),
]


class Clock:
    def __init__(self) -> None:
        self.now = time.time()

    def __call__(self) -> float:
        return self.now

    def advance(self, seconds: float) -> None:
        self.now += seconds


def quota_config(**overrides: Any) -> Any:
    sessions = {"durable": True, "scope": "quota-tests", **overrides.pop("sessions", {})}
    limits = {"session_data_mb": 64, "session_disk": "agent", **overrides.pop("limits", {})}
    return make_test_config(
        quotas={"identities": QUOTAS},
        sessions=sessions,
        limits=limits,
        pool={"size": 2, "session_spares": 0},
        **overrides,
    )


def ledgers(instance: str) -> list[str]:
    listed = subprocess.run(
        ["docker", "volume", "ls", "-q", "--filter", f"label={LABEL_HOLDER}={instance}"],
        capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    return listed.stdout.split()


def remove_ledgers(instances: set[str]) -> None:
    """What the test's servers kept on the engine (a server leaves its counts for the next)."""
    for instance in instances:
        names = ledgers(instance)
        if names:
            subprocess.run(["docker", "volume", "rm", *names], capture_output=True, timeout=60, check=True)


@asynccontextmanager
async def serving(clock: Clock, instances: set[str], **overrides: Any) -> AsyncIterator[SandboxService]:
    async with SandboxService.start(quota_config(**overrides), clock=clock) as service:
        instances.add(service.instance)
        await service.wait_ready()
        try:
            yield service
        finally:
            for session in service.sessions.all():
                await service.close_session(session.owner, session.id)


@pytest.fixture
async def instances() -> AsyncIterator[set[str]]:
    made: set[str] = set()
    yield made
    remove_ledgers(made)


@pytest.fixture
async def service(instances: set[str]) -> AsyncIterator[tuple[SandboxService, Clock]]:
    clock = Clock()
    async with serving(clock, instances) as running:
        yield running, clock


def refusals(quota: str) -> float:
    return float(metrics.QUOTA_REFUSALS.labels(quota=quota)._value.get())


async def refused(service: SandboxService, owner: str, code: str = "1", session_id: str | None = None) -> OverQuota:
    with pytest.raises(OverQuota) as caught:
        await service.run(owner, code, session_id=session_id)
    return caught.value


async def test_runs_past_the_minute_quota_are_refused_and_the_window_passing_frees_them(
    service: tuple[SandboxService, Clock],
) -> None:
    svc, clock = service
    before = refusals("runs_per_minute")
    for _ in range(3):
        assert (await svc.run("token:runs", "1")).status == "ok"
    refusal = await refused(svc, "token:runs")
    said = str(refusal)
    assert said.startswith("quota runs_per_minute reached: your identity started 3 runs in the last 60 s")
    assert "its quota is 3; a run can start again in " in said and "UTC). Nothing was run" in said
    assert refusal.window_s == 60 and refusal.frees_at is not None and refusal.frees_at > clock.now
    assert refusals("runs_per_minute") == before + 1
    assert (await svc.run("token:other", "1")).status == "ok"  # another identity: the default, no limit
    clock.now = refusal.frees_at
    assert (await svc.run("token:runs", "1")).status == "ok"


async def test_cpu_past_the_hour_and_the_day_refuses_runs_until_it_leaves_the_window(
    service: tuple[SandboxService, Clock],
) -> None:
    svc, clock = service
    burnt = await svc.run("token:cpu", BURN.format(s=0.6))
    assert burnt.status == "ok" and burnt.usage is not None and burnt.usage.cpu_s >= 0.58
    refusal = await refused(svc, "token:cpu")
    assert refusal.quota == "cpu_s_per_hour" and "CPU seconds in the last hour, its quota is 0.5" in str(refusal)
    clock.advance(3600 + 120)  # out of the hour's window, still in the day's
    refusal = await refused(svc, "token:cpu")
    assert refusal.quota == "cpu_s_per_day" and "in the last 24 hours, its quota is 0.55" in str(refusal)
    clock.advance(86400)
    assert (await svc.run("token:cpu", "1")).status == "ok"


@pytest.fixture
def index() -> Iterator[LoopbackIndex]:
    with loopback_index() as served, pytest.MonkeyPatch.context() as patch:
        patch.setenv("PIP_INDEX_URL", served.url)
        served.add("quota-one-mcpx", "1.0", 1000)
        served.add("quota-two-mcpx", "1.0", 1000)
        yield served


async def test_an_install_past_the_day_quota_is_refused_whole_before_anything_is_copied_in(
    index: LoopbackIndex, instances: set[str], tmp_path: Any
) -> None:
    clock = Clock()
    async with serving(clock, instances, packages={"cache_dir": str(tmp_path)}) as svc:
        both = await svc.run("token:installs", "%pip install quota-one-mcpx quota-two-mcpx", timeout=60)
        assert both.status == "error" and both.error is not None and both.error.type == "OverQuota"
        assert "quota package_installs_per_day reached: this install brings 2 packages" in both.error.message
        assert "ask for fewer packages" in both.error.message
        one = await svc.run("token:installs", "%pip install quota-one-mcpx\nimport quota_one_mcpx", timeout=60)
        assert one.status == "ok" and one.usage is not None and one.usage.packages_installed == 1, one
        again = await svc.run("token:installs", "%pip install quota-two-mcpx", timeout=60)
        assert again.error is not None and "installed 1 in the last 24 hours, of a quota of 1" in again.error.message
        clock.advance(86400 + 900)
        later = await svc.run("token:installs", "%pip install quota-two-mcpx", timeout=60)
        assert later.status == "ok", later


async def test_the_disk_quota_holds_at_any_time_and_frees_as_sessions_close(
    service: tuple[SandboxService, Clock],
) -> None:
    svc, _ = service
    first = await svc.new_session("token:disk")
    with pytest.raises(OverQuota, match=r"quota stored_mb reached: .* at most 64 MiB of disk at any time") as caught:
        await svc.new_session("token:disk")
    assert caught.value.quota == "stored_mb" and caught.value.window_s is None
    await svc.close_session("token:disk", first.session_id)
    await svc.close_session("token:disk", (await svc.new_session("token:disk")).session_id)


async def test_the_counts_hold_across_a_restart_of_the_server(instances: set[str]) -> None:
    clock = Clock()
    async with serving(clock, instances) as first:
        for _ in range(3):
            await first.run("token:runs", "1")
    (kept,) = ledgers(next(iter(instances)))  # the first server's counts, one ledger for its one identity
    async with serving(clock, instances) as second:  # the same scope: it takes the first one's counts over
        refusal = await refused(second, "token:runs")
        assert ledgers(second.instance) and existing_volumes([kept]) == []  # written again as its own
        assert "started 3 runs in the last 60 s" in str(refusal)
        clock.advance(66)
        assert (await second.run("token:runs", "1")).status == "ok"


async def test_forks_and_other_sessions_of_an_identity_share_its_quota(service: tuple[SandboxService, Clock]) -> None:
    svc, clock = service
    source = (await svc.new_session("token:forker")).session_id
    assert (await svc.run("token:forker", BURN.format(s=0.6), session_id=source)).status == "ok"
    (fork,) = await svc.fork_session("token:forker", source)
    other = (await svc.new_session("token:forker")).session_id
    for session_id in (fork, other, None):
        assert (await refused(svc, "token:forker", session_id=session_id)).quota == "cpu_s_per_hour"
    clock.advance(3600 + 120)
    assert (await svc.run("token:forker", "1", session_id=fork)).status == "ok"


async def test_calls_racing_over_several_sessions_cannot_pass_the_quota_together(
    service: tuple[SandboxService, Clock],
) -> None:
    svc, _ = service
    sessions = [(await svc.new_session("token:racer")).session_id for _ in range(3)]
    outcomes: list[str] = []

    async def one(session_id: str | None) -> None:
        try:
            outcomes.append((await svc.run("token:racer", "1", session_id=session_id)).status)
        except OverQuota:
            outcomes.append("refused")

    async with anyio.create_task_group() as tg:
        for session_id in [*sessions, None, None, None, None, *sessions]:
            tg.start_soon(one, session_id)
    assert outcomes.count("ok") == 5 and outcomes.count("refused") == 5, outcomes


# What a cell leaves burning in the session's container when it ends: a thread of its interpreter,
# and a process of its own (forked twice, in a session of its own), each for 30 s.
LEFT_BURNING = (
    "import threading, time\n"
    "def burn():\n"
    "    end = time.monotonic() + 30\n"
    "    while time.monotonic() < end:\n"
    "        pass\n"
    "threading.Thread(target=burn, daemon=True).start()\n"
)
FORKED_BURNING = (
    "import os, time\n"
    "if os.fork() == 0:\n"
    "    os.setsid()\n"
    "    if os.fork() == 0:\n"
    "        end = time.monotonic() + 30\n"
    "        while time.monotonic() < end:\n"
    "            pass\n"
    "    os._exit(0)\n"
    "os.wait()\n"
)


async def cpu_used(svc: SandboxService, owner: str) -> float:
    return next(each.used for each in await svc.accounting.quotas.standing(owner) if each.quota == "cpu_s_per_hour")


async def burnt_at_least(svc: SandboxService, session_id: str, cpu_s: float, owner: str = "token:idler") -> None:
    """Until the session's container has used ``cpu_s`` more CPU, as its engine counts it (however
    loaded the machine is, unlike a fixed wait)."""
    sandbox = svc.sessions.get(session_id, owner).sandbox
    assert sandbox is not None
    start = await svc.engine.cpu_usage_s(sandbox.container_id)
    assert start is not None
    with anyio.fail_after(60):
        while ((await svc.engine.cpu_usage_s(sandbox.container_id)) or 0.0) < start + cpu_s:  # noqa: ASYNC110 - polls the engine
            await anyio.sleep(0.2)  # pacing of the poll; the engine's figure is the synchronisation


@pytest.mark.parametrize("runtime", RUNTIMES)
async def test_cpu_a_session_burns_between_its_runs_is_charged_to_its_identity(
    runtime: str, instances: set[str]
) -> None:
    async with serving(Clock(), instances, runtime=None if runtime == "runc" else runtime) as svc:
        session_id = (await svc.new_session("token:idler")).session_id
        started = await svc.run("token:idler", LEFT_BURNING, session_id=session_id)
        assert started.status == "ok" and started.usage is not None and started.usage.cpu_s < 1.0, started
        await burnt_at_least(svc, session_id, 3.0)  # while no run is going
        assert (await svc.run("token:idler", "x = 1", session_id=session_id)).status == "ok"
        before_close = await cpu_used(svc, "token:idler")
        assert before_close >= 3.0  # what the thread burnt between the runs
        await burnt_at_least(svc, session_id, 0.5)  # more than a reading's rounding (0.1 s), since it was charged
        await svc.close_session("token:idler", session_id)
        assert await cpu_used(svc, "token:idler") > before_close  # and it burnt on until the container went
    if runtime == "runsc":
        await wait_until(lambda: not runsc_leftovers(), 30)


async def test_a_process_a_cell_left_burning_is_charged_when_its_session_is_paused(
    service: tuple[SandboxService, Clock],
) -> None:
    svc, _ = service
    session_id = (await svc.new_session("token:idler")).session_id
    assert (await svc.run("token:idler", FORKED_BURNING, session_id=session_id)).status == "ok"
    await anyio.sleep(3)  # not synchronisation: the span the process burns while no run is going
    assert await svc.keeper.pause(svc.sessions.get(session_id, "token:idler"))
    assert await cpu_used(svc, "token:idler") >= 2.0  # charged as the container went, with no run since


BURN_FOREVER = (
    "import threading\ndef burn():\n    while True:\n        pass\nthreading.Thread(target=burn, daemon=True).start()\n"
)


async def test_a_run_refused_before_its_cell_does_not_forgive_what_its_session_burnt(
    service: tuple[SandboxService, Clock],
) -> None:
    svc, _ = service
    sid = (await svc.new_session("token:idler")).session_id
    assert (await svc.run("token:idler", BURN_FOREVER, session_id=sid)).status == "ok"
    for _ in range(3):
        refused = await svc.run("token:idler", "%pip install", session_id=sid)
        assert refused.error is not None and refused.error.type == "PackageError", refused
        await anyio.sleep(9.5)  # not synchronisation: the span burnt while no run goes, past a timer's pass
    session = svc.sessions.get(sid, "token:idler")
    assert session.sandbox is not None
    used = await svc.engine.cpu_usage_s(session.sandbox.container_id)
    assert used is not None and used > 20  # the thread had a whole CPU (limits.cpus) for ~28 s
    assert await cpu_used(svc, "token:idler") >= used - 12  # at most a timer's period unread


async def test_an_identity_past_its_cpu_quota_has_its_idle_sessions_paused_and_nothing_burns_on(
    service: tuple[SandboxService, Clock],
) -> None:
    svc, clock = service
    sid = (await svc.new_session("token:burner")).session_id
    assert (await svc.run("token:burner", "kept = 42\n" + BURN_FOREVER, session_id=sid)).status == "ok"
    session = svc.sessions.get(sid, "token:burner")
    assert session.sandbox is not None
    container = session.sandbox.container_id
    await burnt_at_least(svc, sid, 2.5, owner="token:burner")  # past the quota of 2, while no run goes
    await svc.accounting.settle(session, unused=True)  # what the timer does every SETTLE_S
    await wait_until(lambda: session.paused, 60)  # its snapshot kept, its container given back
    await wait_until(lambda: container not in project_containers(instance=svc.instance), 60)  # nothing burns on
    charged = await cpu_used(svc, "token:burner")
    assert charged >= 2.5
    assert (await refused(svc, "token:burner", session_id=sid)).quota == "cpu_s_per_hour"
    await svc.accounting.settle(session, unused=True)
    assert await cpu_used(svc, "token:burner") == charged  # no container, nothing more to charge
    clock.advance(3600 + 120)  # the quota frees: the session resumes as any paused one
    again = await svc.run("token:burner", "print(kept)", session_id=sid)
    assert again.status == "ok" and again.stdout.strip() == "42", again
