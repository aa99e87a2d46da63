"""The seam between the supervisor and what runs on it: ``SupervisorPort``, what a run and the
session need of the supervisor, and all they may use of it.

The supervisor owns the host channel, the zygote and the spare worker; a run (``runner.Runner``)
and the session's parts (``interpreter_keeper.InterpreterKeeper`` and the parts it holds) reach
them only through this protocol, so the request loop and the life of a run or a session can each
be read on their own.
"""

from __future__ import annotations

from typing import Any, Protocol

from ..handles import WorkerHandle


class SupervisorPort(Protocol):
    """What a run and the session need of the supervisor, and all they may use of it."""

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        """Send one frame to the host."""

    def watched_fds(self) -> dict[int, str]:
        """Descriptors a run waits on besides its worker's: ``"channel"`` (the host) or ``"news"`` (the zygote)."""

    def read_channel(self, request_id: int) -> tuple[int, bool]:
        """Read what the host sent: (interrupts of run ``request_id``, whether the channel closed).
        Other requests wait for the request loop."""

    def take_zygote_news(self) -> None:
        """Take the workers the zygote spawned and the exits it reported."""

    # The host's answers to the running cell's tool calls, and pauses of its clock, read so far.
    def take_tool_messages(self) -> list[tuple[dict[str, Any], bytes]]: ...

    def exit_status(self, pid: int) -> int | None:
        """The wait status the zygote reported for worker ``pid``; None while it is not known gone."""

    def forget_exits(self, keep: WorkerHandle | None) -> None:
        """Drop the exit statuses of workers that are neither the spare nor ``keep``."""

    def take_worker(self) -> WorkerHandle:
        """A fresh worker (the spare)."""

    def order_spare(self) -> None:
        """Have the zygote fork the next spare worker, unless one is there or on its way."""

    def kill_sandbox_processes(self) -> bool:
        """Kill every process of the sandbox user and drop the spare; False if some survive."""

    def others_alive(self, worker: WorkerHandle) -> bool:
        """Whether a process of the sandbox user runs besides ``worker`` and the spare."""
