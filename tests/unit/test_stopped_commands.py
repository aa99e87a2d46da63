"""A one-off command stopped by SIGTERM unwinds: its work is cancelled, what it made is removed,
and the processes it started end with it (``commands.stoppable``, ``commands.offline_base``)."""

from __future__ import annotations

import os
import signal
import threading
from collections.abc import Callable
from pathlib import Path

import anyio
import pytest

from mcp_code_exec.commands.offline_base import mounts_under, run_in_own_group
from mcp_code_exec.commands.stoppable import Stopped, run_until_stopped

BOUND_S = 20


def gone(pid: int) -> bool:
    """The process has ended (a zombie waiting for a reaper that is not us counts as ended)."""
    try:
        return Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0] == "Z"
    except (FileNotFoundError, ProcessLookupError):
        return True


async def until(predicate: Callable[[], bool]) -> None:
    with anyio.fail_after(BOUND_S):
        while not predicate():  # noqa: ASYNC110 - a state outside this process (a file, /proc)
            await anyio.sleep(0.02)


def test_sigterm_cancels_the_work_and_its_cleanup_runs_before_the_command_ends(tmp_path: Path) -> None:
    made = tmp_path / "context"

    async def work() -> None:
        made.mkdir()
        try:
            os.kill(os.getpid(), signal.SIGTERM)
            await anyio.sleep_forever()
        finally:
            made.rmdir()

    with pytest.raises(Stopped) as stopped:
        run_until_stopped(work)
    assert stopped.value.exit_code == 143
    assert str(stopped.value) == "stopped by SIGTERM"
    assert not made.exists()


def test_a_command_that_is_not_stopped_returns_its_value_and_raises_its_own_errors() -> None:
    async def answer() -> int:
        return 42

    async def fail() -> None:
        raise ValueError("the build failed")

    assert run_until_stopped(answer) == 42
    with pytest.raises(ValueError, match="the build failed"):  # itself, not an exception group
        run_until_stopped(fail)
    assert signal.getsignal(signal.SIGTERM) == signal.SIG_DFL  # the process's own handling is back


@pytest.mark.anyio
@pytest.mark.parametrize("leader", ["", "trap '' TERM; "], ids=["ends-on-term", "ignores-term"])
async def test_a_cancelled_process_group_ends_whole(tmp_path: Path, leader: str) -> None:
    pids = tmp_path / "pids"
    script = f"{leader}sleep 300 & echo $$ $! > {pids}; wait"
    with anyio.CancelScope() as scope:
        async with anyio.create_task_group() as group:
            group.start_soon(run_in_own_group, ["sh", "-c", script], 0.5)
            await until(lambda: len(pids.read_text().split()) == 2 if pids.exists() else False)
            scope.cancel()
    assert scope.cancelled_caught
    shell, child = (int(pid) for pid in pids.read_text().split())
    try:
        await until(lambda: gone(shell) and gone(child))
    finally:
        for pid in (shell, child):  # what a failure left running
            if not gone(pid):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.anyio
async def test_a_process_group_that_ends_reports_its_code_and_its_stderr() -> None:
    assert await run_in_own_group(["sh", "-c", "echo nope >&2; exit 3"]) == (3, "nope\n")


def test_mount_points_under_a_directory_are_found_with_the_kernels_escapes(tmp_path: Path) -> None:
    work = tmp_path / "a work dir"
    table = tmp_path / "mountinfo"
    escaped = str(work).replace(" ", "\\040")
    table.write_text(
        f"22 1 0:21 / / rw - ext4 /dev/root rw\n"
        f"30 22 0:5 / {escaped}/rootfs/proc rw - proc proc rw\n"
        f"31 22 0:6 / {escaped}/rootfs/dev rw - devtmpfs udev rw\n"
        f"32 22 0:7 / {escaped}-other/dev rw - devtmpfs udev rw\n"
    )
    assert mounts_under(str(work), str(table)) == [f"{work}/rootfs/proc", f"{work}/rootfs/dev"]


def test_a_command_run_outside_the_main_thread_runs_without_watching_signals() -> None:
    async def answer() -> int:
        return 7

    results: list[int] = []
    worker = threading.Thread(target=lambda: results.append(run_until_stopped(answer)))
    worker.start()
    worker.join(BOUND_S)
    assert results == [7]
