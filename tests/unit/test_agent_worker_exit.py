"""A stateless worker stays until the supervisor lets it go: its exit (the address space torn
down) then comes after the run's done event has left, not while the supervisor reads its done."""

from __future__ import annotations

import os
import select
import sys
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent import protocol
from mcpx_agent.worker import mcp_tools, worker

STILL_WAITING_S = 0.3  # how long the worker must still be waiting after its results end (it returns at once otherwise)
BOUND_S = 10.0


@pytest.fixture
def pipes() -> Iterator[dict[str, int]]:
    control_r, control_w = os.pipe()
    results_r, results_w = os.pipe()
    ends = {"control_r": control_r, "control_w": control_w, "results_r": results_r, "results_w": results_w}
    yield ends  # a test pops the ends it closed (or saw closed), so no reused number is closed here
    for fd in ends.values():
        os.close(fd)


def serve_in_thread(monkeypatch: pytest.MonkeyPatch, pipes: dict[str, int]) -> tuple[threading.Thread, list[int]]:
    monkeypatch.setattr(worker, "CONTROL_FD", pipes["control_r"])
    monkeypatch.setattr(worker, "RESULT_FD", pipes["results_w"])
    monkeypatch.setattr(worker, "warm_up", lambda shell: None)
    monkeypatch.setattr(mcp_tools, "CHANNEL", mcp_tools.Channel())

    def execute(shell: Any, code: str, options: dict[str, Any]) -> None:
        os.write(pipes["results_w"], b"done")

    monkeypatch.setattr(worker, "execute", execute)
    returned: list[int] = []
    thread = threading.Thread(target=lambda: returned.append(worker.serve_forever(None)), daemon=True)  # type: ignore[arg-type]
    thread.start()
    return thread, returned


def read_to_the_end(fd: int) -> bytes:
    """What ``fd`` gives until its write end closes, within ``BOUND_S``."""
    got = b""
    deadline = time.monotonic() + BOUND_S
    while select.select([fd], [], [], max(0.0, deadline - time.monotonic()))[0]:
        chunk = os.read(fd, 4096)
        if not chunk:
            return got
        got += chunk
    raise AssertionError(f"the results did not end within {BOUND_S} s (got {got!r})")


def test_a_stateless_worker_waits_after_its_done_until_its_control_pipe_closes(
    monkeypatch: pytest.MonkeyPatch, pipes: dict[str, int]
) -> None:
    thread, returned = serve_in_thread(monkeypatch, pipes)
    os.write(pipes["control_w"], protocol.encode({"options": {}, "once": True}, b"print(1)"))
    got = read_to_the_end(pipes["results_r"])
    pipes.pop("results_w")  # the worker closed it (its results ended), so it is not ours to close
    assert got == b"done"
    thread.join(STILL_WAITING_S)
    assert thread.is_alive() and not returned  # still there: the supervisor has not let it go
    os.close(pipes.pop("control_w"))
    thread.join(BOUND_S)
    assert not thread.is_alive()
    assert returned == [0]


def test_a_session_worker_serves_its_next_cell_after_a_done(
    monkeypatch: pytest.MonkeyPatch, pipes: dict[str, int]
) -> None:
    thread, returned = serve_in_thread(monkeypatch, pipes)
    for _ in range(2):
        os.write(pipes["control_w"], protocol.encode({"options": {}, "once": False}, b"x = 1"))
    os.close(pipes.pop("control_w"))  # the session ends: the worker returns
    thread.join(BOUND_S)
    assert not thread.is_alive() and returned == [0]
    os.close(pipes.pop("results_w"))
    assert read_to_the_end(pipes["results_r"]) == b"donedone"
