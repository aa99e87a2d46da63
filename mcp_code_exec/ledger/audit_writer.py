"""The audit log's own thread, which writes the lines the event loop records, so that neither a slow
disk nor a sync holds the loop.

Waking a thread (a futex, the GIL handed over) costs more here than writing a line, so the thread,
once woken, lets ``GATHER_S`` pass and takes every line recorded by then in that one wake: a run's
end records two lines (its call and its usage), and runs end many times a second under load. A line
is on its way to the file within that time; what a kill -9 loses is what was not written yet, as
before.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import deque
from collections.abc import Callable
from typing import Generic, TypeVar

log = logging.getLogger(__name__)
T = TypeVar("T")
GATHER_S = 0.05


class WriterThread(Generic[T]):
    """Calls ``write`` with each item ``put``, in order, on a thread of its own; ``write`` is expected
    to handle its own failures (one it raises is logged, and the next item is written)."""

    def __init__(self, write: Callable[[T], object], name: str, gather_s: float = GATHER_S) -> None:
        self._write = write
        self._gather_s = gather_s
        self._pending: deque[T] = deque()  # appended on the loop, taken on the thread
        self._due = threading.Event()
        self._lock = threading.Lock()  # a put and the close: no item is put once the thread may be done
        self._closing = False
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._thread.start()

    def put(self, item: T) -> bool:
        """False once closing (the item was not taken: the caller writes it itself)."""
        with self._lock:
            if self._closing:
                return False
            self._pending.append(item)
        if not self._due.is_set():
            self._due.set()
        return True

    def _run(self) -> None:
        while True:
            self._due.wait()
            self._due.clear()  # before anything is read: a put or a close from now on wakes it again
            with self._lock:
                closing = self._closing  # everything put before the close is taken below
            if not closing:
                time.sleep(self._gather_s)
            while self._pending:
                item = self._pending.popleft()
                try:
                    self._write(item)
                except Exception:  # the thread must outlive any one line
                    log.exception("the audit log's writer could not write a line")
            if closing:
                return

    def close(self, timeout_s: float) -> None:
        """Write what was put, then end (waiting at most ``timeout_s``)."""
        with self._lock:
            self._closing = True
        self._due.set()
        self._thread.join(timeout_s)
