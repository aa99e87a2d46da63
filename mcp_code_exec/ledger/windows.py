"""Rolling windows counted in steps: what an identity used in the last minute, hour or day.

A charge lands in the step of its time and counts until that step's end plus the window's length:
at least the length after it was made, at most one step more, so "60 runs a minute" is never more
than 60 in any 60 seconds. A window holds at most ``length / step + 1`` numbers, whatever the
number of charges. Times are the wall clock, since the counts outlive the process; a step dated in
the future (the clock was set back) is counted as the present one's, so a clock set back neither
frees what was used nor holds it more than one window past the change.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

MAX_ENCODED_BUCKETS = 200  # more in a stored state than any window holds: it is not ours


@dataclass
class Window:
    length_s: float
    step_s: float
    buckets: dict[int, float] = field(default_factory=dict)  # step index -> amount

    def _expiry(self, index: int) -> float:
        return (index + 1) * self.step_s + self.length_s

    def tidy(self, now: float) -> None:
        """Drop the steps that left the window; fold steps dated in the future into the present one."""
        current = math.floor(now / self.step_s)
        for index in [i for i in self.buckets if i > current]:
            self.buckets[current] = self.buckets.get(current, 0.0) + self.buckets.pop(index)
        for index in [i for i in self.buckets if self._expiry(i) <= now]:
            del self.buckets[index]

    def add(self, now: float, amount: float) -> None:
        if amount <= 0 or not math.isfinite(amount):
            return
        self.tidy(now)
        index = math.floor(now / self.step_s)
        self.buckets[index] = self.buckets.get(index, 0.0) + amount

    def total(self, now: float) -> float:
        self.tidy(now)
        return sum(self.buckets.values())

    def frees_at(self, now: float, amount: float) -> float | None:
        """When at least ``amount`` of what is counted now will have left the window (``now`` when
        nothing needs to; None when less than ``amount`` is counted at all)."""
        if amount <= 0:
            return now
        self.tidy(now)
        gone = 0.0
        for index in sorted(self.buckets):
            gone += self.buckets[index]
            if gone >= amount - 1e-9:
                return self._expiry(index)
        return None

    @property
    def empty(self) -> bool:
        return not self.buckets

    def merge(self, other: Window) -> None:
        for index, amount in other.buckets.items():
            self.buckets[index] = self.buckets.get(index, 0.0) + amount

    def encode(self) -> str:
        return ",".join(f"{index}:{amount:.6g}" for index, amount in sorted(self.buckets.items()))

    def decode(self, text: str) -> None:
        """Add a stored window's steps (one that is not a window of ours adds nothing)."""
        found: dict[int, float] = {}
        for part in text.split(",")[:MAX_ENCODED_BUCKETS] if text else ():
            index_text, _, amount_text = part.partition(":")
            try:
                index, amount = int(index_text), float(amount_text)
            except ValueError:
                return
            if not math.isfinite(amount) or amount < 0 or abs(index) > 1 << 40:
                return
            found[index] = found.get(index, 0.0) + amount
        self.merge(Window(self.length_s, self.step_s, found))
