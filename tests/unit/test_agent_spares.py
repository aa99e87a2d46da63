"""Which zygote's worker waits for the next cell (``mcpx_agent.supervisor.spares``): the full
zygote's, until lean cells come in a row; a cell never gets a worker that lacks what it needs."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent.handles import WorkerHandle
from mcpx_agent.supervisor.spares import LEAN_SPARE_AFTER, Spares


class FakeZygote:
    def __init__(self, ordered: list[FakeZygote]) -> None:
        self.ordered = ordered
        self.orders = 0

    def order(self) -> None:
        self.orders += 1
        self.ordered.append(self)


class Forks:
    """Two fake zygotes, the spares over them, and the workers they 'fork' (real pipes, fake pids)."""

    def __init__(self, *, lean: bool = True) -> None:
        self.ordered: list[FakeZygote] = []  # forks asked for and not delivered yet
        self.full, self.lean = FakeZygote(self.ordered), FakeZygote(self.ordered) if lean else None
        self.killed: list[int] = []
        self.gone: set[int] = set()
        self.spares = Spares(self.full, self.lean, kill=self.killed.append)
        self.handles: list[WorkerHandle] = []
        self.next_pid = 1000

    def deliver(self) -> WorkerHandle:
        """The zygote that was ordered forks: its worker arrives."""
        assert self.spares.ordered
        ordered = self.ordered.pop(0)
        ends = [end for _ in range(4) for end in os.pipe()]
        self.handles.append(handle := WorkerHandle(self.next_pid, ends[0], ends[2], ends[4], ends[7]))
        for fd in (ends[1], ends[3], ends[5], ends[6]):
            os.close(fd)
        self.next_pid += 1
        self.spares.delivered(handle, ordered)
        return handle

    def take(self, *, lean: bool) -> WorkerHandle | None:
        return self.spares.take(lean=lean, gone=self.gone.__contains__)

    def cell(self, *, lean: bool) -> WorkerHandle:
        """A stateless cell as the supervisor runs it: counted, then its worker, waiting for a fork if need be."""
        self.spares.cell(lean=lean)
        for _ in range(3):  # at most: a spare that does not fit, its replacement
            if (handle := self.take(lean=lean)) is not None:
                break
            self.deliver()
        else:
            raise AssertionError("no spare fit the cell")
        handle.close()
        self.spares.order()  # after the run, as ``reset_after_stateless`` does
        return handle

    def close(self) -> None:
        for handle in self.handles:
            handle.close()


@pytest.fixture
def forks() -> Iterator[Forks]:
    made = Forks()
    yield made
    made.close()


def closed(handle: WorkerHandle) -> bool:
    try:
        os.fstat(handle.control)
    except OSError:
        return True
    return False


def test_the_first_spare_is_the_full_zygotes_and_one_fork_at_a_time_is_ordered(forks: Forks) -> None:
    forks.spares.order()
    forks.spares.order()  # one is on its way: not a second
    assert (forks.full.orders, forks.lean.orders if forks.lean else 0) == (1, 0)
    spare = forks.deliver()
    assert not forks.spares.is_lean
    assert forks.spares.pids() == {spare.pid}  # its exit status is kept, so its pid is never killed once reused
    forks.spares.order()  # one is there: not another
    assert forks.full.orders == 1


def test_a_spare_delivered_over_another_closes_the_others_pipes(forks: Forks) -> None:
    forks.spares.order()
    first = forks.deliver()
    forks.spares.ordered = True  # as if a second fork had been ordered (the zygote answers each order)
    forks.ordered.append(forks.full)
    second = forks.deliver()
    assert closed(first) and not closed(second)
    assert forks.killed == []


def test_a_lean_spare_is_ordered_only_after_lean_cells_in_a_row(forks: Forks) -> None:
    assert forks.lean is not None
    forks.spares.order()
    for _ in range(LEAN_SPARE_AFTER - 1):
        forks.cell(lean=True)
    assert forks.lean.orders == 0  # one lean cell among full ones keeps full spares
    forks.cell(lean=True)
    assert forks.lean.orders == 1
    forks.deliver()
    assert forks.spares.is_lean
    forks.cell(lean=True)  # the lean cell takes the lean spare
    assert forks.killed == []


def test_a_full_cell_never_takes_a_lean_spare_it_drops_it_and_waits_for_a_full_one(forks: Forks) -> None:
    forks.spares.order()
    for _ in range(LEAN_SPARE_AFTER):
        forks.cell(lean=True)
    lean_spare = forks.deliver()
    full_orders = forks.full.orders
    forks.spares.cell(lean=False)
    assert forks.take(lean=False) is None
    assert forks.killed == [lean_spare.pid]  # alive, so killed by its own pid
    assert closed(lean_spare)
    assert forks.full.orders == full_orders + 1
    forks.deliver()
    assert not forks.spares.is_lean
    assert forks.take(lean=False) is not None


def test_a_full_cell_ends_the_streak_so_the_next_spare_is_full_again(forks: Forks) -> None:
    assert forks.lean is not None
    forks.spares.order()
    for _ in range(LEAN_SPARE_AFTER):
        forks.cell(lean=True)
    forks.cell(lean=False)
    lean_orders = forks.lean.orders
    forks.cell(lean=True)
    assert forks.lean.orders == lean_orders  # one lean cell after a full one: a full spare again


def test_a_lean_cell_takes_a_full_spare(forks: Forks) -> None:
    forks.spares.order()
    full_spare = forks.deliver()
    forks.spares.cell(lean=True)
    assert forks.take(lean=True) is full_spare


def test_a_spare_that_died_is_dropped_without_a_kill_and_replaced(forks: Forks) -> None:
    forks.spares.order()
    dead = forks.deliver()
    forks.gone.add(dead.pid)  # reaped: its pid may be another process's now
    assert forks.take(lean=False) is None
    assert forks.killed == [] and closed(dead)
    assert forks.full.orders == 2
    assert forks.take(lean=False) is None  # ordered once, not again while it is on its way
    assert forks.full.orders == 2
    assert forks.deliver().pid == forks.take(lean=False).pid  # type: ignore[union-attr]


def test_without_a_lean_zygote_every_spare_is_the_full_ones() -> None:
    forks = Forks(lean=False)
    try:
        forks.spares.order()
        for _ in range(LEAN_SPARE_AFTER + 3):
            forks.cell(lean=False)  # the supervisor calls no cell lean without a lean zygote
        assert forks.full.orders == LEAN_SPARE_AFTER + 4
    finally:
        forks.close()


def test_a_spare_killed_with_the_sandbox_users_processes_is_forgotten_and_the_next_ordered(forks: Forks) -> None:
    forks.spares.order()
    spare = forks.deliver()
    forks.spares.forget()
    assert forks.spares.handle is None and forks.spares.pids() == set() and closed(spare)
    forks.spares.order()
    assert forks.full.orders == 2


def test_forgetting_while_a_fork_is_on_its_way_orders_no_second_one(forks: Forks) -> None:
    forks.spares.order()
    forks.spares.forget()  # the kill may have met the fork on its way; the zygote still answers the order
    forks.spares.order()
    assert forks.full.orders == 1


def test_a_lean_spare_that_died_is_replaced_for_a_lean_cell_without_a_kill(forks: Forks) -> None:
    assert forks.lean is not None
    forks.spares.order()
    for _ in range(LEAN_SPARE_AFTER):
        forks.cell(lean=True)
    dead = forks.deliver()
    assert forks.spares.is_lean
    forks.gone.add(dead.pid)
    forks.spares.cell(lean=True)
    assert forks.take(lean=True) is None
    assert forks.killed == [] and forks.lean.orders == 2
    assert forks.deliver().pid == forks.take(lean=True).pid  # type: ignore[union-attr]
