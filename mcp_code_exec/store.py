"""Files left in /mnt/data by stateless runs, kept on the host for a bounded time and size."""

from __future__ import annotations

import time
from collections import OrderedDict
from dataclasses import dataclass, field

from .errors import SessionNotFound


@dataclass
class StoredRun:
    owner: str
    expires: float
    files: dict[str, tuple[bytes, float]] = field(default_factory=dict)

    @property
    def size(self) -> int:
        return sum(len(data) for data, _ in self.files.values())


class RunFileStore:
    def __init__(self, *, keep_s: float, max_total_bytes: int) -> None:
        self.keep_s = keep_s
        self.max_total_bytes = max_total_bytes
        self._runs: OrderedDict[str, StoredRun] = OrderedDict()
        self._total = 0

    def put(self, run_id: str, owner: str, files: dict[str, tuple[bytes, float]]) -> None:
        self._expire()
        run = StoredRun(owner=owner, expires=time.monotonic() + self.keep_s, files=files)
        self._runs[run_id] = run
        self._total += run.size
        while self._total > self.max_total_bytes and self._runs:
            _, oldest = self._runs.popitem(last=False)
            self._total -= oldest.size

    def get(self, run_id: str, owner: str, path: str) -> tuple[bytes, float] | None:
        self._expire()
        run = self._runs.get(run_id)
        if run is None or run.owner != owner:
            raise SessionNotFound(run_id)
        return run.files.get(path)

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
