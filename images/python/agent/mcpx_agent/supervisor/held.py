"""The session runs whose history lines are not written yet (``journal``): the history is written once
the session is idle, or before anything reads or copies the session's state, not while an agent's
loop sends its next run. What is held is bounded: when the held runs reach the history's cap (their
code, outputs and images) or ``MAX_HELD_RUNS``, they are written at once.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from typing import Any

MAX_HELD_RUNS = 256  # enough to spread the file's opening over a loop's runs, few enough to write in one go
LINE_OVERHEAD = 256  # the keys and numbers of a run's line, beyond its texts


@dataclass
class HeldRun:
    """A run's history line without its number (given when it is written), and its images' bytes."""

    entry: dict[str, Any]
    images: list[tuple[str, bytes]]  # (extension, bytes), in the order the run displayed them
    cap: int  # the history's cap the run was made with


@dataclass
class HeldRuns:
    held: list[HeldRun] = field(default_factory=list)
    held_bytes: int = 0

    def add(self, run: HeldRun) -> bool:
        """Hold a run; True when what is held must be written now (at its bound)."""
        self.held.append(run)
        self.held_bytes += held_size(run)
        return self.held_bytes >= run.cap or len(self.held) >= MAX_HELD_RUNS

    def take(self) -> list[HeldRun]:
        """The held runs, oldest first; none are held after."""
        taken, self.held, self.held_bytes = self.held, [], 0
        return taken


def held_size(run: HeldRun) -> int:
    """About the bytes the run's line and images will take (the texts counted as characters)."""
    entry = run.entry
    error = entry["error"] or {}
    texts = [entry["code"], entry["stdout"], entry["stderr"], str(entry["result"] or ""), *entry["displays"]]
    texts += [str(error.get(key, "")) for key in ("type", "message", "traceback")]
    size = LINE_OVERHEAD + sum(len(text) for text in texts) + sum(len(blob) for _, blob in run.images)
    if entry["tables"]:
        size += len(json.dumps(entry["tables"], ensure_ascii=False))
    return size
