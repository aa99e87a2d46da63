"""A session's container's CPU as charged to its owner (``accounting.Accounting`` reads the engine's
figure and charges; this is the bookkeeping a ``Session`` keeps of it): which container the figure is
of, the CPU seconds charged for it (its runs and between them), and when its engine last gave a
figure, or its container came (monotonic: nothing burnt there before). What is charged for a
container never exceeds its figure once read: more than it used, charged already (a run's charge at
the CPU limit after its figure was lost), buys none of what it burns later."""

from __future__ import annotations

import time
from dataclasses import dataclass, field


@dataclass(eq=False, kw_only=True)
class ContainerCpu:
    cpu_container: str = ""
    cpu_charged_s: float = 0.0
    cpu_read_at: float = field(default_factory=time.monotonic)

    def cpu_started(self, container_id: str, total: float = 0.0) -> None:
        """``container_id``'s CPU counts from ``total`` (its first figure: nothing of it is charged), or,
        for a container started for this session, from its creation (its start is the session's)."""
        self.cpu_container, self.cpu_charged_s, self.cpu_read_at = container_id, total, time.monotonic()

    def cpu_ran(self, container_id: str, charged: float) -> None:
        """A run in ``container_id`` was charged ``charged``: that counts as charged for the container
        (all it used counts from nothing where it was never read)."""
        if self.cpu_container != container_id:
            self.cpu_container, self.cpu_charged_s = container_id, 0.0
        self.cpu_charged_s += charged
        self.cpu_read_at = time.monotonic()

    def cpu_read(self, total: float) -> float:
        """The container's figure ``total`` was read: what it used uncharged (0 where more than it used
        was charged already: the count goes on from its figure)."""
        self.cpu_read_at = time.monotonic()
        self.cpu_charged_s = min(self.cpu_charged_s, total)
        return total - self.cpu_charged_s

    def cpu_settled(self, idle: float, *, final: bool) -> None:
        """``idle`` CPU seconds were charged for the container; ``final``: it goes, nothing of it is kept."""
        self.cpu_charged_s += idle
        if final:
            self.cpu_container = ""

    def cpu_forget(self) -> None:
        """The container went with all it could have used charged: nothing of it is kept."""
        self.cpu_container = ""
