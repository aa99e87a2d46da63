"""The audit log's writer thread: every line put is written, in order, closing included, however
its puts fall against the thread's wakes."""

from __future__ import annotations

import threading

from mcp_code_exec.ledger.audit_writer import WriterThread


def test_every_item_put_is_written_in_order_before_close_returns() -> None:
    for _ in range(200):  # puts land before, during and after the thread's wakes
        written: list[int] = []
        writer = WriterThread(written.append, "test-writer")
        for n in range(50):
            writer.put(n)
        writer.close(10.0)
        assert written == list(range(50))


def test_a_put_while_the_thread_writes_is_taken_without_another_wake() -> None:
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
