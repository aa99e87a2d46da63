"""The session's worker: the interpreter a container's session runs its cells in, and its one owner.

``SessionWorker`` holds the worker's handle. Every part of the session that ends or replaces the
worker does it here: a run that killed every process lets it go, the quota watch stops everything,
a session request the worker failed replaces it. The next run then gets a fresh one (``live``),
and learns whether that restarted the session: the worker it held died since, or was stopped or
replaced between runs (one that went with a run was let go, and that run said so).
"""

from __future__ import annotations

from ..handles import WorkerHandle
from .port import SupervisorPort
from .worker_requests import end, gone


class SessionWorker:
    """The session's worker, a fresh one when it is gone."""

    def __init__(self, supervisor: SupervisorPort) -> None:
        self.supervisor = supervisor
        self.handle: WorkerHandle | None = None
        self.stopped_between_runs = False  # the worker was stopped between runs: the next run is told

    def live(self) -> tuple[WorkerHandle, bool]:
        """The session's worker, a fresh one if it is gone; and whether it had to be replaced."""
        if self.handle is not None and self.supervisor.exit_status(self.handle.pid) is None:
            restarted, self.stopped_between_runs = self.stopped_between_runs, False  # replaced since
            return self.handle, restarted
        restarted = self.handle is not None or self.stopped_between_runs
        self.stopped_between_runs = False
        self.let_go()
        self.handle = self.supervisor.take_worker()
        return self.handle, restarted

    def running(self) -> WorkerHandle | None:
        """The session's worker while it lives (None: there is none, or it is gone)."""
        handle = self.handle
        return None if handle is None or gone(self.supervisor, handle) else handle

    def let_go(self) -> None:
        """The session's worker was killed: its handle is closed, and the next run gets a fresh one."""
        if self.handle is not None:
            self.handle.close()
        self.handle = None

    def kill_sandbox_processes(self) -> bool:
        """Kill every process of the sandbox user, the session's worker and the spare included."""
        killed = self.supervisor.kill_sandbox_processes()
        self.let_go()
        return killed

    def stop_between_runs(self, *, told: bool = False) -> None:
        """Stop every process of the session between runs: the next run is told its worker is new,
        unless the run that just ended says so itself (``told``)."""
        self.kill_sandbox_processes()
        self.stopped_between_runs = not told

    def replace(self, handle: WorkerHandle, *, told: bool = False) -> None:
        """The session's worker failed a request: it goes, and a fresh one takes its place. The next
        run is told its variables are gone, unless the answer to this request says so (``told``)."""
        end(self.supervisor, handle)
        if self.handle is handle:
            self.handle = self.supervisor.take_worker()
            self.supervisor.order_spare()
        if not told:
            self.stopped_between_runs = True
