"""Runs that may outlive the call that started them: their ids, owners, output so far and outcome.

A run starts when a call asks for it and goes on in the service's task group whatever happens
to that call: a client that gives up waiting (its own timeout) gets the run's id back and can
fetch the result later (``get_run``), or stop it (``cancel_run``). Bookkeeping only: the
execution itself is ``execution.py``'s.
"""

from __future__ import annotations

import secrets
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Protocol

import anyio

from ..config.sections import RunSettings
from ..errors import ClientLimit, RunNotFound
from ..models import RunResult
from ..observability import metrics
from ..sandbox.spec import Kind
from .output_log import OutputLog

if TYPE_CHECKING:
    from ..broker.broker import RunBudget


def new_run_id() -> str:
    return "r_" + secrets.token_urlsafe(12)


@dataclass(eq=False)
class Run:
    id: str
    owner: str
    session_id: str | None
    timeout_s: float
    code: str = ""  # the cell, capped (for the notebook view of a stateless run)
    code_sha256: str = ""  # of the whole cell, for the audit log
    code_bytes: int = 0
    started: float = field(default_factory=time.monotonic)
    started_at: float = field(default_factory=time.time)  # wall clock, for clients
    output: OutputLog = field(default_factory=OutputLog)
    result: RunResult | None = None
    finished: anyio.Event = field(default_factory=anyio.Event)
    finished_at: float | None = None
    cancel_scope: anyio.CancelScope = field(default_factory=anyio.CancelScope)
    cancelled: bool = False
    delivered: bool = False  # the whole result (images included) reached a caller once
    read_positions: dict[str, int] = field(default_factory=lambda: {"stdout": 0, "stderr": 0})
    tool_budget: RunBudget | None = None  # code mode: its tool calls so far, and approvals waiting
    packages_installed: int = 0  # what the server copied in for it (its usage)

    @property
    def done(self) -> bool:
        return self.finished.is_set()

    @property
    def kind(self) -> Kind:
        return "stateless" if self.session_id is None else "session"

    def stop_clock(self) -> None:
        """The run's time ends now (``finish`` comes once its usage, counted up to here, is known)."""
        self.finished_at = time.monotonic()

    def finish(self, result: RunResult) -> None:
        metrics.run_finished(self.kind, result.status, self.started)
        result.run_id = self.id
        self.result = result
        self.finished_at = self.finished_at or time.monotonic()
        self.finished.set()
        self.output.close()

    def delivered_once(self) -> bool:
        """Its whole result goes to a caller now: True the first time (its images go out then only)."""
        first, self.delivered = not self.delivered, True
        return first

    def drop_images(self, note: str) -> None:
        """Its result without its images, and ``note`` saying why."""
        assert self.result is not None
        self.result = self.result.model_copy(update={"images": [], "notes": [*self.result.notes, note]})

    def installed(self, count: int) -> None:
        """Packages the server copied in for it (for its usage)."""
        self.packages_installed += count

    def held_bytes(self) -> int:
        """What this finished run holds in server memory: its result and the output kept for polls."""
        return kept_bytes(self.result) + sum(map(len, self.output.chunks.values()))

    def cancel(self) -> None:
        self.cancelled = True
        self.cancel_scope.cancel()

    def progress(self) -> RunResult:
        """A running run as a result: status ``running`` and the output new since the last one."""
        texts = {}
        for stream in ("stdout", "stderr"):
            texts[stream] = self.output.since(stream, self.read_positions[stream])
            self.read_positions[stream] = self.output.end(stream)
        elapsed = (time.monotonic() - self.started) * 1000
        return RunResult(
            status="running",
            stdout=texts["stdout"],
            stderr=texts["stderr"],
            duration_ms=round(elapsed, 1),
            run_id=self.id,
            session_id=self.session_id,
        )


class RunWatcher(Protocol):
    """Told of every run that ends, whoever waits for it (bounded; its failures are logged): the MCP
    face's ``Notifier`` (``mcp_server/notify.py``), which tells the owner's clients of the files the
    run changed. Held weakly (``Executor.watch``): a watcher that is gone is told no more."""

    async def run_finished(self, run: Run) -> None: ...


ITEM_OVERHEAD = 512  # what one more file, note, display or image costs in memory beyond its text


def kept_bytes(result: RunResult | None) -> int:
    """What a finished run's result holds in server memory: all of its text (output, value,
    displays, error, each file's path, URI and note, notes), an allowance per item, and images."""
    if result is None:
        return 0
    items = len(result.files) + len(result.notes) + len(result.displays) + len(result.images) + len(result.truncated)
    text = len(result.model_dump_json())  # every field but the images' bytes, which are excluded
    inline = sum(len(info.text.encode()) for info in result.files if info.text is not None)  # excluded from the dump
    return text + inline + items * ITEM_OVERHEAD + sum(len(image.data) for image in result.images)


class RunRegistry:
    """Every run by id, for its owner only; finished ones are kept ``keep_s`` for ``get_run``.

    Running runs and finished ones are held apart, the finished in the order they were seen to end,
    so keeping the registry in bounds costs the number of runs going now, not the number kept.

    What finished runs hold is bounded three ways: ``max_kept`` runs and ``max_kept_bytes`` in all,
    ``max_per_owner`` runs per client. Past a bound the client holding the most gives way first
    (undelivered images go before whole runs), so one client's flood sheds its own results and
    not another client's."""

    def __init__(
        self, *, keep_s: float, max_kept: int = 1000, max_kept_bytes: int = 256 << 20, max_per_owner: int = 100
    ) -> None:
        self.keep_s = keep_s
        self.max_kept = max_kept
        self.max_kept_bytes = max_kept_bytes
        self.max_per_owner = max_per_owner
        self._running: dict[str, Run] = {}
        self._finished: OrderedDict[str, Run] = OrderedDict()  # oldest end first
        self._sizes: dict[str, int] = {}  # run id -> kept bytes, for finished runs
        self._owner_bytes: dict[str, int] = {}
        self._owner_runs: dict[str, list[str]] = {}  # owner -> ids of finished runs, oldest first
        self.kept_bytes = 0

    @classmethod
    def kept_as(cls, settings: RunSettings) -> RunRegistry:
        """A registry keeping finished runs as ``[runs]`` says: how long, and how much of them."""
        return cls(
            keep_s=settings.keep_s, max_kept_bytes=settings.max_kept_bytes, max_per_owner=settings.max_kept_per_client
        )

    def add(self, run: Run) -> None:
        metrics.run_started(run.kind)
        self._expire()
        self._running[run.id] = run

    def get(self, run_id: str, owner: str) -> Run:
        self._expire()
        run = None
        if isinstance(run_id, str):
            run = self._running.get(run_id) or self._finished.get(run_id)
        if run is None or run.owner != owner:
            raise RunNotFound(str(run_id)[:100])
        return run

    def running(self, owner: str | None = None) -> list[Run]:
        return [run for run in self._running.values() if not run.done and owner in (None, run.owner)]

    def __len__(self) -> int:
        return len(self._running) + len(self._finished)

    def deliver(self, run: Run) -> RunResult:
        """A finished run's whole result. Images go out once: a later get_run says they were sent."""
        assert run.result is not None
        result = run.result
        if run.delivered_once() and result.images:
            self._drop_images(run, "were returned when this run's result was first delivered")
        return result

    def _drop_images(self, run: Run, why: str) -> None:
        """The result without its images, a note saying why, and the books kept."""
        assert run.result is not None
        run.drop_images(f"{run.result.image_count} image(s) {why}")
        self.resize(run)

    def resize(self, run: Run) -> None:
        """Account again for a finished run whose result changed (its images went out)."""
        if run.id in self._sizes:
            self._account(run, run.held_bytes() - self._sizes[run.id])

    def _account(self, run: Run, delta: int) -> None:
        self._sizes[run.id] = self._sizes.get(run.id, 0) + delta
        self._owner_bytes[run.owner] = self._owner_bytes.get(run.owner, 0) + delta
        self.kept_bytes += delta

    def _expire(self) -> None:
        for run in [run for run in self._running.values() if run.done]:
            del self._running[run.id]
            self._finished[run.id] = run
            self._owner_runs.setdefault(run.owner, []).append(run.id)
            self._account(run, run.held_bytes())
            if len(self._owner_runs[run.owner]) > self.max_per_owner:
                self._forget(self._owner_runs[run.owner][0])
        now = time.monotonic()
        while self._finished:
            oldest = next(iter(self._finished.values()))
            if oldest.finished_at is None or now - oldest.finished_at <= self.keep_s:
                break
            self._forget(oldest.id)
        while self._finished and (len(self._finished) > self.max_kept or self.kept_bytes > self.max_kept_bytes):
            self._shed(max(self._owner_runs, key=lambda owner: self._owner_bytes.get(owner, 0)))

    def _shed(self, owner: str) -> None:
        """Free some of ``owner``'s kept results: the oldest undelivered images, else the oldest run."""
        if len(self._finished) <= self.max_kept:
            for run_id in self._owner_runs[owner]:
                run = self._finished[run_id]
                if run.result is not None and run.result.images:
                    self._drop_images(
                        run,
                        "of this run were dropped before anyone fetched them: "
                        "the server keeps unfetched results in bounded memory",
                    )
                    return
        self._forget(self._owner_runs[owner][0])

    def _forget(self, run_id: str) -> None:
        run = self._finished.pop(run_id)
        self._account(run, -self._sizes.pop(run_id, 0))
        ids = self._owner_runs[run.owner]
        ids.remove(run_id)
        if not ids:
            del self._owner_runs[run.owner]
            self._owner_bytes.pop(run.owner, None)


class ClientSlots:
    """At most ``limit`` concurrent runs per client identity; more wait their turn, for a bound."""

    def __init__(self, limit: int, wait_s: float) -> None:
        self.limit = limit
        self.wait_s = wait_s
        self._held: dict[str, int] = {}
        self._freed = anyio.Event()

    def held(self, owner: str) -> int:
        return self._held.get(owner, 0)

    async def acquire(self, owner: str) -> None:
        if self.limit <= 0:
            return
        with anyio.move_on_after(self.wait_s):
            while self._held.get(owner, 0) >= self.limit:
                await self._freed.wait()
            self._held[owner] = self._held.get(owner, 0) + 1
            return
        metrics.rejected("client_limit")
        raise ClientLimit(
            f"your limit of {self.limit} runs at once is reached and none ended within {self.wait_s:.0f} s; "
            "wait for one to end (get_run), stop one (cancel_run), or retry"
        )

    def release(self, owner: str) -> None:
        if self.limit <= 0:
            return
        left = self._held.get(owner, 0) - 1
        if left > 0:
            self._held[owner] = left
        else:
            self._held.pop(owner, None)
        self._freed.set()
        self._freed = anyio.Event()
