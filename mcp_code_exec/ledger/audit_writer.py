"""The audit log's own thread, which writes the lines the event loop records, so that neither a slow
disk nor a sync holds the loop.

A line recorded while the thread is already due to wake is taken in that same wake: the end of a run
records two lines (its call and its usage) a few microseconds apart, and waking a thread (a futex,
the GIL handed over) costs more than writing a line.
"""

from __future__ import annotations

import threading
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

T = TypeVar("T")


class WriterThread(Generic[T]):
    """Calls ``write`` with each item ``put``, in order, on a thread of its own."""

    def __init__(self, write: Callable[[T], object], name: str) -> None:
        self._write = write
        self._pending: deque[T] = deque()  # appended on the loop, taken on the thread (both atomic)
        self._due = threading.Event()
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: T) -> None:
        self._pending.append(item)
        if not self._due.is_set():
            self._due.set()

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()
            closing = self._closing  # read first: what was put before ``close`` is taken below
            while self._pending:
                self._write(self._pending.popleft())
            if closing:
                return

    def close(self, timeout_s: float) -> None:
        """Write what was put, then end (waiting at most ``timeout_s``)."""
        self._closing = True
        self._due.set()
        self._thread.join(timeout_s)
