"""A one-off command stopped by SIGTERM unwinds: its work is cancelled, what it made is removed,
and the processes it started end with it (``commands.stoppable``, ``commands.offline_base``)."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import tarfile
import tempfile
import threading
from collections.abc import Callable, Iterator
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import anyio
import pytest

from mcp_code_exec.commands.offline_base import mounts_under, run_in_own_group
from mcp_code_exec.commands.stoppable import run_until_stopped
from mcp_code_exec.runtime.docker.images import ImageBuilder
from mcp_code_exec.runtime.processes import signal_group, stop_group

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


# A command in a process of its own (the signals are sent to it, never to the test run): it makes a
# directory, signals itself with the first of ``argv[2]``, and sends the others while it unwinds.
COMMAND = """
import os, signal, sys, anyio
from mcp_code_exec.commands.stoppable import Stopped, run_until_stopped
from mcp_code_exec.runtime.docker.images import ImageBuilder

def mine(signum, frame):
    pass

signal.signal(signal.SIGTERM, mine)
signal.signal(signal.SIGHUP, signal.SIG_IGN)
made, sent = sys.argv[1], [getattr(signal, name) for name in sys.argv[2].split(",")]
bound_s = 1 if sent == [signal.SIGHUP] else 20  # an ignored signal: nothing is to happen meanwhile

async def work():
    os.mkdir(made)
    try:
        with anyio.fail_after(bound_s):
            os.kill(os.getpid(), sent[0])
            await anyio.sleep_forever()
    finally:
        for extra in sent[1:]:
            os.kill(os.getpid(), extra)
        os.rmdir(made)

try:
    run_until_stopped(work)
except Stopped as stop:
    kept = signal.getsignal(signal.SIGTERM) is mine and signal.getsignal(signal.SIGHUP) is signal.SIG_IGN
    print(stop, "handlers kept" if kept else "handlers lost")
    sys.exit(stop.exit_code)
except TimeoutError:
    print("not stopped")
"""


@pytest.mark.parametrize(
    ("sent", "said", "code"),
    [
        ("SIGTERM", "stopped by SIGTERM handlers kept", 143),
        ("SIGINT", "stopped by SIGINT handlers kept", 130),
        ("SIGTERM,SIGTERM,SIGINT", "stopped by SIGTERM handlers kept", 143),  # later ones while it unwinds
        ("SIGHUP", "not stopped", 0),  # ignored, as under nohup
    ],
    ids=["sigterm", "ctrl-c", "repeated", "ignored-sighup"],
)
def test_a_stopping_signal_cancels_the_work_and_its_cleanup_runs_before_the_command_ends(
    tmp_path: Path, sent: str, said: str, code: int
) -> None:
    made = tmp_path / "context"
    done = subprocess.run(
        [sys.executable, "-c", COMMAND, str(made), sent], capture_output=True, text=True, timeout=60, check=False
    )
    assert (done.returncode, done.stdout.strip()) == (code, said), done.stderr
    assert not made.exists()


UNSTOPPED = """
import signal
from mcp_code_exec.commands.stoppable import run_until_stopped

async def answer():
    return 42

async def fail():
    raise ValueError("the build failed")

print(run_until_stopped(answer))
try:
    run_until_stopped(fail)
except ValueError as exc:  # itself, not an exception group
    print(repr(exc))
print(signal.getsignal(signal.SIGTERM) == signal.SIG_DFL, signal.getsignal(signal.SIGINT) is signal.default_int_handler)
"""


def test_a_command_that_is_not_stopped_returns_its_value_and_raises_its_own_errors() -> None:
    # In a process of its own: the main thread of the test run may be running an event loop.
    done = subprocess.run([sys.executable, "-c", UNSTOPPED], capture_output=True, text=True, timeout=60, check=False)
    assert done.stdout.splitlines() == ["42", "ValueError('the build failed')", "True True"], done.stderr


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
async def test_a_stdio_server_that_ends_when_its_stdin_closes_leaves_nothing_of_its_group(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    script = f"sleep 300 & echo $$ $! > {pids}; read line; exit 0"  # like npx: ends on EOF, its child does not
    process = await anyio.open_process(["sh", "-c", script], start_new_session=True)
    try:
        await until(lambda: len(pids.read_text().split()) == 2 if pids.exists() else False)
        await stop_group(process, grace_s=5, close_stdin=True)
        assert process.returncode == 0  # it ended on its own, at the close
        shell, child = (int(pid) for pid in pids.read_text().split())
        await until(lambda: gone(shell) and gone(child))
    finally:
        signal_group(process, signal.SIGKILL)
        await process.aclose()


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


@pytest.mark.anyio
async def test_the_build_context_reaches_the_engine_as_an_unnamed_file(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A process stopped while it uploads its context leaves no archive behind (the SDK's own is a
    named temporary file, which only its ``close`` removes)."""
    temp = tmp_path / "tmp"
    temp.mkdir()
    context = tmp_path / "context"
    context.mkdir()
    (context / "Dockerfile").write_text("FROM scratch\n")
    monkeypatch.setattr(tempfile, "tempdir", str(temp))
    uploaded: list[tuple[list[str], list[str]]] = []

    class Api:
        def build(self, *, fileobj: Any, custom_context: bool, **_: Any) -> Iterator[dict[str, str]]:
            assert custom_context
            with tarfile.open(fileobj=fileobj) as archive:
                uploaded.append((os.listdir(temp), archive.getnames()))
            yield {"stream": "Step 1/1 : FROM scratch\n"}

    class Engine:
        client = SimpleNamespace(api=Api())

        async def call(self, fn: Callable[[], None]) -> None:
            fn()

    lines: list[str] = []
    await ImageBuilder(Engine()).build(str(context), "t:1", {}, lines.append)  # type: ignore[arg-type]
    assert uploaded == [([], ["Dockerfile"])] and lines == ["Step 1/1 : FROM scratch"]
