"""Bookkeeping of runs: output for pollers, the registry, per-client slots."""

from __future__ import annotations

import anyio
import pytest

from mcp_code_exec.errors import ClientLimit, RunNotFound
from mcp_code_exec.models import RunResult
from mcp_code_exec.runs import ClientSlots, OutputLog, Run, RunRegistry

pytestmark = pytest.mark.anyio


async def test_each_poll_of_a_running_run_gets_only_what_is_new() -> None:
    run = Run(id="r_1", owner="me", session_id=None, timeout_s=10)
    run.output.add("stdout", "one\n")
    assert run.progress().stdout == "one\n"
    run.output.add("stdout", "two\n")
    run.output.add("stderr", "warn\n")
    second = run.progress()
    assert (second.stdout, second.stderr, second.status) == ("two\n", "warn\n", "running")
    assert run.progress().stdout == ""


async def test_output_past_what_is_kept_is_marked_as_dropped() -> None:
    log = OutputLog(kept=10)
    log.add("stdout", "0123456789abcdef")
    assert log.since("stdout", 0) == "[... 6 characters not kept ...]\n6789abcdef"
    assert log.end("stdout") == 16


async def test_a_finished_run_is_kept_for_its_owner_then_forgotten() -> None:
    registry = RunRegistry(keep_s=0.0)
    run = Run(id="r_2", owner="me", session_id=None, timeout_s=10)
    registry.add(run)
    assert registry.get("r_2", "me") is run
    with pytest.raises(RunNotFound):
        registry.get("r_2", "someone else")
    run.finish(RunResult(status="ok"))
    assert run.result is not None and run.result.run_id == "r_2"
    with pytest.raises(RunNotFound):
        registry.get("r_2", "me")  # keep_s is 0: already expired


async def test_past_max_kept_the_oldest_finished_runs_go_first_and_running_ones_stay() -> None:
    registry = RunRegistry(keep_s=3600, max_kept=2)
    runs = [Run(id=f"r_{i}", owner="me", session_id=None, timeout_s=10) for i in range(5)]
    for run in runs:
        registry.add(run)
    for run in runs[:4]:
        run.finish(RunResult(status="ok"))
    registry.add(Run(id="r_new", owner="me", session_id=None, timeout_s=10))
    for gone in ("r_0", "r_1"):
        with pytest.raises(RunNotFound):
            registry.get(gone, "me")
    assert [registry.get(i, "me").id for i in ("r_2", "r_3", "r_4")] == ["r_2", "r_3", "r_4"]
    assert len(registry) == 4 and [run.id for run in registry.running()] == ["r_4", "r_new"]


async def test_a_client_past_its_slots_waits_for_one_then_is_told_its_limit() -> None:
    slots = ClientSlots(limit=1, wait_s=0.2)
    await slots.acquire("alice")
    await slots.acquire("bob")  # slots are per client
    with pytest.raises(ClientLimit, match="your limit of 1 runs at once"):
        await slots.acquire("alice")
    async with anyio.create_task_group() as tg:
        tg.start_soon(slots.acquire, "alice")  # waits for the slot alice holds
        await anyio.wait_all_tasks_blocked()
        slots.release("alice")
    assert slots.held("alice") == 1


async def test_no_limit_means_no_waiting() -> None:
    slots = ClientSlots(limit=0, wait_s=0)
    for _ in range(100):
        await slots.acquire("alice")
    assert slots.held("alice") == 0
