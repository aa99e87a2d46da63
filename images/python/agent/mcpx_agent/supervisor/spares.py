"""The spare worker: one worker forked ahead of the next cell, off the request path, and which
zygote it comes from.

A stateless cell that needs none of the data libraries (``routing``) runs in either zygote's worker;
any other cell, and every session's, needs the full zygote's. The spare is the full zygote's until
``LEAN_SPARE_AFTER`` lean cells came in a row: a workload that mixes both kinds never waits for a
fork, and a full cell after a lean streak waits for one, once (its lean spare is dropped).

    order() ──▶ zygote forks ──▶ delivered(handle) ──▶ take(lean) ──▶ the cell's worker
                                                         │ does not fit, or gone
                                                         ▼
                                                 dropped (killed), next ordered
"""

from __future__ import annotations

import contextlib
import os
import signal
from collections.abc import Callable
from typing import Protocol

from ..handles import WorkerHandle

LEAN_SPARE_AFTER = 2


class Forks(Protocol):
    """Of a zygote, what the spares use: asking it to fork the next worker."""

    def order(self) -> None: ...


def kill(pid: int) -> None:
    with contextlib.suppress(ProcessLookupError, PermissionError):
        os.kill(pid, signal.SIGKILL)


class Spares:
    """The spare worker, the zygote it comes from, and the streak of lean cells that chooses it."""

    def __init__(self, full: Forks, lean: Forks | None, kill: Callable[[int], None] = kill) -> None:
        self.full = full
        self.lean = lean  # the lean zygote (``zygote.lean``), where there is one
        self.kill = kill
        self.handle: WorkerHandle | None = None
        self.ordered = False  # a fork is on its way
        self.is_lean = False  # the spare is the lean zygote's
        self.lean_streak = 0  # lean cells in a row (``cell``)

    def pids(self) -> set[int]:
        return set() if self.handle is None else {self.handle.pid}

    def order(self) -> None:
        """Have a zygote fork the next spare, unless one is there or on its way."""
        if self.handle is None and not self.ordered:
            streak = self.lean_streak >= LEAN_SPARE_AFTER
            (self.lean if self.lean is not None and streak else self.full).order()
            self.ordered = True

    def delivered(self, handle: WorkerHandle, zygote: Forks) -> None:
        """``zygote`` forked ``handle``: it is the spare now."""
        self.ordered = False
        if self.handle is not None:
            self.handle.close()
        self.handle, self.is_lean = handle, zygote is self.lean

    def cell(self, *, lean: bool) -> None:
        """A cell is about to take a worker: ``lean``, it needs none of the data libraries."""
        self.lean_streak = self.lean_streak + 1 if lean and self.lean is not None else 0

    def take(self, *, lean: bool, gone: Callable[[int], bool]) -> WorkerHandle | None:
        """The spare, if it is alive and fits the cell (``lean``: either kind; else the full
        zygote's). One that does not fit, or is ``gone``, is dropped and the next one ordered; None
        then: wait for the zygote's news and ask again."""
        spare, self.handle = self.handle, None
        if spare is not None:
            alive = not gone(spare.pid)  # not reaped yet, so the pid is still its own
            if alive and (lean or not self.is_lean):
                return spare
            if alive:
                self.kill(spare.pid)
            spare.close()
        self.order()
        return None

    def forget(self) -> None:
        """The spare was killed with the rest of the sandbox user's processes."""
        if self.handle is not None:
            self.handle.close()
        self.handle = None
