"""A fork the zygote cannot make (a run's processes hold every pid, or the memory) costs a retry,
never the zygote: without it the container could run no more code."""

from __future__ import annotations

import os
import socket
import sys
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent.handles import WorkerHandle
from mcpx_agent.worker import worker
from mcpx_agent.zygote.zygote import SPAWNED, deliver_worker


def open_fds() -> set[str]:
    return set(os.listdir("/proc/self/fd"))


def no_process() -> Any:
    raise BlockingIOError(11, "Resource temporarily unavailable")


def test_a_failed_fork_delivers_nothing_and_a_later_one_delivers_the_worker() -> None:
    ours, supervisor = socket.socketpair()
    with ours, supervisor:
        supervisor.setblocking(False)
        assert deliver_worker(ours, no_process) is False
        with pytest.raises(BlockingIOError):
            supervisor.recv(64)  # nothing was said: the supervisor still waits for its worker
        ends = [end for _ in range(4) for end in os.pipe()]
        handle = WorkerHandle(pid=4242, stdout=ends[0], stderr=ends[2], results=ends[4], control=ends[7])
        assert deliver_worker(ours, lambda: handle) is True
        data, ancdata, _, _ = supervisor.recvmsg(64, socket.CMSG_SPACE(16))
        passed = [fd for _, _, blob in ancdata for fd in memoryview(blob).cast("i")]
    assert data[:1] == SPAWNED
    assert len(passed) == 4
    for fd in [*passed, ends[1], ends[3], ends[5], ends[6]]:
        os.close(fd)


def test_a_fork_that_fails_in_spawn_leaves_no_descriptor_behind(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(os, "fork", no_process)
    before = open_fds()
    with pytest.raises(BlockingIOError):
        worker.spawn(None)  # type: ignore[arg-type]  # the shell is only the child's
    assert open_fds() == before
