"""Bookkeeping of runs: output for pollers, the registry, per-client slots."""

from __future__ import annotations

from contextlib import aclosing

import anyio
import pytest

from mcp_code_exec.errors import ClientLimit, RunNotFound
from mcp_code_exec.models import FileInfo, ImageOutput, RunResult
from mcp_code_exec.service.output_log import OutputLog
from mcp_code_exec.service.run_registry import ClientSlots, Run, RunRegistry
from mcp_code_exec.service.sessions import KNOWN_FILES_MAX, Session

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


async def test_a_follower_gets_each_batch_as_it_comes_and_the_last_one_after_the_run_ends() -> None:
    run = Run(id="r_f", owner="me", session_id=None, timeout_s=10)
    run.output.add("stdout", "before\n")
    seen: dict[str, list[list[tuple[str, str]]]] = {"start": [], "now": []}

    async def follow(key: str, from_now: bool) -> None:
        async with aclosing(run.output.follow(from_now=from_now)) as batches:
            async for batch in batches:
                seen[key].append(batch)

    with anyio.fail_after(5):
        async with anyio.create_task_group() as tg:
            tg.start_soon(follow, "start", False)
            tg.start_soon(follow, "now", True)
            await anyio.wait_all_tasks_blocked()
            run.output.add("stderr", "warn\n")
            run.output.add("stdout", "after\n")
            await anyio.wait_all_tasks_blocked()
            run.output.add("stdout", "last\n")
            run.finish(RunResult(status="ok"))
    assert seen["start"] == [
        [("stdout", "before\n")],
        [("stdout", "after\n"), ("stderr", "warn\n")],
        [("stdout", "last\n")],
    ]
    assert seen["now"] == [[("stdout", "after\n"), ("stderr", "warn\n")], [("stdout", "last\n")]]


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


def finished_with_images(registry: RunRegistry, run_id: str, owner: str, images: int, size: int = 1000) -> Run:
    run = Run(id=run_id, owner=owner, session_id=None, timeout_s=10)
    registry.add(run)
    pictures = [ImageOutput(mime_type="image/png", data=b"x" * size) for _ in range(images)]
    run.finish(RunResult(status="ok", stdout="out", images=pictures, image_count=images))
    return run


async def test_a_flood_of_unfetched_images_sheds_the_flooders_own_results_not_another_clients() -> None:
    registry = RunRegistry(keep_s=3600, max_kept_bytes=100_000)
    victim = finished_with_images(registry, "r_victim", "victim", images=2)
    for i in range(50):
        finished_with_images(registry, f"r_{i}", "attacker", images=5)
    registry.add(Run(id="r_next", owner="attacker", session_id=None, timeout_s=10))  # settles the books
    assert registry.kept_bytes <= 100_000
    assert registry.get("r_victim", "victim") is victim
    assert victim.result is not None and len(victim.result.images) == 2
    kept = registry.get("r_49", "attacker").result
    assert kept is not None and kept.stdout == "out"  # the text stays longest
    oldest = registry.get("r_0", "attacker").result
    assert oldest is not None and oldest.images == [] and "dropped before anyone fetched them" in oldest.notes[-1]


async def test_a_client_keeps_at_most_its_share_of_finished_runs() -> None:
    registry = RunRegistry(keep_s=3600, max_per_owner=3)
    finished_with_images(registry, "r_other", "other", images=0)
    for i in range(6):
        finished_with_images(registry, f"r_{i}", "me", images=0)
    registry.add(Run(id="r_next", owner="me", session_id=None, timeout_s=10))
    with pytest.raises(RunNotFound):
        registry.get("r_2", "me")
    assert [registry.get(f"r_{i}", "me").id for i in (3, 4, 5)] == ["r_3", "r_4", "r_5"]
    assert registry.get("r_other", "other").id == "r_other"


async def test_a_delivered_result_no_longer_counts_its_images() -> None:
    registry = RunRegistry(keep_s=3600)
    run = finished_with_images(registry, "r_1", "me", images=3)
    registry.add(Run(id="r_next", owner="me", session_id=None, timeout_s=10))
    with_images = registry.kept_bytes
    assert with_images >= 3000
    assert len(registry.deliver(run).images) == 3
    assert registry.kept_bytes < with_images - 3000
    assert registry.deliver(run).images == [] and "were returned" in registry.deliver(run).notes[-1]


def many_files(count: int, tag: str = "") -> list[FileInfo]:
    name = "d" * 250 + "/" + "e" * 250 + "/" + "f" * 250 + "/"
    return [
        FileInfo(path=f"{name}{tag}{i:04}", size=0, modified=0.0, uri=f"sandbox://x/{name}{tag}{i:04}", note="n")
        for i in range(count)
    ]


async def test_kept_results_count_their_files_and_notes_against_the_budget() -> None:
    registry = RunRegistry(keep_s=3600, max_kept_bytes=2 << 20)
    for i in range(40):  # each result names 100 files of 1 KB paths: about 0.3 MB of text apiece
        run = Run(id=f"r_{i}", owner="me", session_id=None, timeout_s=10)
        registry.add(run)
        run.finish(RunResult(status="ok", files=many_files(100), notes=["n" * 10_000] * 10))
    registry.add(Run(id="r_next", owner="me", session_id=None, timeout_s=10))
    assert 1 << 20 < registry.kept_bytes <= 2 << 20
    with pytest.raises(RunNotFound):
        registry.get("r_0", "me")  # the oldest gave way: files and notes weigh what they hold
    assert registry.get("r_39", "me").id == "r_39"


async def test_a_finished_runs_output_kept_for_polls_counts_against_the_budget() -> None:
    registry = RunRegistry(keep_s=3600, max_kept_bytes=1 << 20)
    for i in range(10):
        run = Run(id=f"r_{i}", owner="me", session_id=None, timeout_s=10)
        registry.add(run)
        run.output.add("stdout", "x" * 200_000)
        run.finish(RunResult(status="ok"))
    registry.add(Run(id="r_next", owner="me", session_id=None, timeout_s=10))
    assert registry.kept_bytes <= 1 << 20
    with pytest.raises(RunNotFound):
        registry.get("r_0", "me")


def test_a_session_remembers_a_bounded_number_of_its_files_the_latest_seen() -> None:
    session = Session(id="s_1", owner="me", volume=None, sandbox=None)
    for run in range(10):
        session.remember(many_files(2000, tag=f"run{run}-"))
        assert len(session.known_files) == KNOWN_FILES_MAX
    assert all("run9-" in path for path in session.known_files)
    session.relist(many_files(3))
    assert len(session.known_files) == 3


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
