"""Files left in /mnt/data by stateless runs, kept on the host for a bounded time and size.

Keyed by the run's id (the same id ``get_run`` takes), readable by the run's owner only.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from ..config.sections import RunSettings
from ..errors import RunNotFound

FILE_OVERHEAD = 512  # what one more kept file costs in memory beyond its path and bytes


@dataclass
class StoredRun:
    owner: str
    expires: float
    files: dict[str, tuple[bytes, float]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        """What the run's files hold in memory: bytes, paths and an allowance per file (a run of
        many empty files with long names weighs what it holds, not nothing)."""
        return sum(len(data) + len(path) + FILE_OVERHEAD for path, (data, _) in self.files.items())


class RunFileStore:
    def __init__(self, *, keep_s: float, max_total_bytes: int) -> None:
        self.keep_s = keep_s
        self.max_total_bytes = max_total_bytes
        self._runs: OrderedDict[str, StoredRun] = OrderedDict()
        self._total = 0

    @classmethod
    def kept_as(cls, settings: RunSettings) -> RunFileStore:
        """A store keeping stateless runs' files as ``[runs]`` says: how long, and how much of them."""
        return cls(keep_s=settings.files_keep_s, max_total_bytes=settings.files_max_total_bytes)

    def put(self, run_id: str, owner: str, files: dict[str, tuple[bytes, float]]) -> None:
        self._expire()
        run = StoredRun(owner=owner, expires=time.monotonic() + self.keep_s, files=files)
        self._runs[run_id] = run
        self._total += run.size
        while self._total > self.max_total_bytes and self._runs:
            self._forget(self._oldest_of(self._biggest_holder()))

    def _biggest_holder(self) -> str:
        """The client whose kept files weigh most: past the budget it gives way first, so that
        one client's many runs evict its own files, not another client's."""
        held: dict[str, int] = {}
        for run in self._runs.values():
            held[run.owner] = held.get(run.owner, 0) + run.size
        return max(held, key=held.__getitem__)

    def _oldest_of(self, owner: str) -> str:
        return next(rid for rid, run in self._runs.items() if run.owner == owner)

    def _forget(self, run_id: str) -> None:
        self._total -= self._runs.pop(run_id).size

    def get(self, run_id: str, owner: str, path: str) -> tuple[bytes, float] | None:
        return self._run(run_id, owner).files.get(path)

    def files(self, run_id: str, owner: str) -> list[tuple[str, int, float]]:
        """(path, size, modified) of each file kept from one run."""
        return [
            (path, len(data), modified) for path, (data, modified) in sorted(self._run(run_id, owner).files.items())
        ]

    def _run(self, run_id: str, owner: str) -> StoredRun:
        self._expire()
        run = self._runs.get(run_id) if isinstance(run_id, str) else None
        if run is None or run.owner != owner:
            raise RunNotFound(str(run_id)[:100])
        return run

    def listing(self, owner: str) -> list[tuple[str, str, int]]:
        self._expire()
        return [
            (rid, path, len(data))
            for rid, run in self._runs.items()
            if run.owner == owner
            for path, (data, _) in run.files.items()
        ]

    def _expire(self) -> None:
        now = time.monotonic()
        for run_id in [rid for rid, run in self._runs.items() if run.expires <= now]:
            self._total -= self._runs.pop(run_id).size
