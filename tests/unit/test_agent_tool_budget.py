"""The worker refuses a cell's tool calls past the run's budget itself, however many of the cell's
threads call at once: the host, which refuses them too, stops a run that sends twice as many."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent import protocol
from mcpx_agent.worker import mcp_tools

BUDGET = 5
THREADS = 40


def test_threads_calling_at_once_send_no_more_calls_than_the_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    read_end, write_end = os.pipe()
    monkeypatch.setattr(mcp_tools, "RESULT_FD", write_end)
    slow_send = protocol.send
    go = threading.Barrier(THREADS)

    def send(fd: int, header: dict[str, object], payload: bytes = b"") -> None:
        threading.Event().wait(0.001)  # a slow pipe: the other threads pile up behind the write
        slow_send(fd, header, payload)

    monkeypatch.setattr(protocol, "send", send)
    channel = mcp_tools.Channel()
    mcp_tools.CHANNEL, saved = channel, mcp_tools.CHANNEL
    refused: list[str] = []

    def call() -> None:
        go.wait(10)
        try:
            channel.send("time", "now", {}, False)
        except mcp_tools.ToolBudgetExceeded as exc:
            refused.append(str(exc))

    try:
        mcp_tools.before_cell([{"server": "time", "tool": "now", "name": "now", "params": []}], BUDGET)
        threads = [threading.Thread(target=call) for _ in range(THREADS)]
        for thread in threads:
            thread.start()
        for thread in threads:
            thread.join(10)
        os.close(write_end)
        frames = protocol.FrameReader(read_end, max_header=1 << 16, max_payload=1 << 20)
        sent = []
        while not frames.eof:
            frames.fill()
            sent += frames.frames()
    finally:
        mcp_tools.CHANNEL = saved
        os.close(read_end)
    assert len(sent) == BUDGET and [header["kind"] for header, _ in sent] == ["call"] * BUDGET
    assert refused == [f"this run has used its {BUDGET} tool calls"] * (THREADS - BUDGET)


def test_a_cell_gets_its_own_budget_and_a_bogus_one_means_none() -> None:
    channel = mcp_tools.CHANNEL
    for given, kept in ((3, 3), (0, None), ("3", None), (True, None), (None, None)):
        channel.sent = 7
        mcp_tools.before_cell(None, given)
        assert (channel.budget, channel.sent) == (kept, 0)
