"""The audit log's writer thread: every line put is written, in order, closing included, however
its puts fall against the thread's wakes."""

from __future__ import annotations

import threading
import time
from pathlib import Path
from types import SimpleNamespace

import pytest

from mcp_code_exec.config.accounting import AuditSettings
from mcp_code_exec.ledger import audit as audit_module
from mcp_code_exec.ledger import audit_writer
from mcp_code_exec.ledger.audit import AuditLog
from mcp_code_exec.ledger.audit_writer import WriterThread


def test_every_item_put_is_written_in_order_before_close_returns() -> None:
    for _ in range(200):  # puts land before, during and after the thread's wakes
        written: list[int] = []
        writer = WriterThread(written.append, "test-writer")
        for n in range(50):
            writer.put(n)
        writer.close(10.0)
        assert written == list(range(50))


def test_a_put_while_the_thread_writes_is_taken_in_that_same_pass() -> None:
    writing, release = threading.Event(), threading.Event()
    written: list[int] = []

    def slow(n: int) -> None:
        writing.set()
        assert release.wait(10.0)
        written.append(n)

    writer = WriterThread(slow, "test-writer")
    writer.put(0)
    assert writing.wait(10.0)
    writer.put(1)
    writer.put(2)  # both while the first is being written: taken in the same pass
    release.set()
    writer.close(10.0)
    assert written == [0, 1, 2]


def test_a_close_while_the_thread_gathers_lines_ends_it_with_every_line_written(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    gathering = threading.Event()

    def sleep(seconds: float) -> None:
        gathering.set()
        time.sleep(seconds)

    monkeypatch.setattr(audit_writer, "time", SimpleNamespace(sleep=sleep))
    written: list[int] = []
    writer = WriterThread(written.append, "test-writer", gather_s=0.5)
    writer.put(1)
    assert gathering.wait(5.0)  # the close comes while the thread gathers
    writer.close(5.0)
    assert written == [1]
    assert not writer._thread.is_alive()
    assert writer.put(2) is False and written == [1]  # closed: the caller writes it itself


def test_a_line_whose_write_raises_does_not_end_the_thread() -> None:
    written: list[int] = []

    def write(n: int) -> None:
        if n == 1:
            raise RuntimeError("a fault of ours")
        written.append(n)

    writer = WriterThread(write, "test-writer", gather_s=0.0)
    for n in range(3):
        writer.put(n)
    writer.close(5.0)
    assert written == [0, 2]


def test_a_line_that_fails_for_a_reason_other_than_the_disk_marks_the_log_failing(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    audit = AuditLog(AuditSettings(path=str(tmp_path / "audit.log"), required=True))
    audit.open(background=True)

    def broken(*args: object, **kwargs: object) -> tuple[bytes, str]:
        raise TypeError("a fault of ours")

    monkeypatch.setattr(audit_module, "seal", broken)
    audit.record("call", tool="new_session", identity="local", outcome="ok")
    audit.close()  # the line is written (and fails) before the close returns
    status = audit.status()
    assert status is not None and status["ok"] is False and "a fault of ours" in status["error"]
    assert status["lost"] >= 1
