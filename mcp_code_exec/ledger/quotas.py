"""Quotas per identity over time: runs a minute, CPU seconds an hour and a day, package installs a day.

Each identity with a quota has a tally of rolling windows (``windows``), kept by the hash of its
identity. A check and its charge happen with no await between them, so two calls racing cannot
both pass the last unit of a quota; CPU is charged when a run ends (what it used is known only
then), so a run admitted under the quota may take the identity past it, and the next run waits.

Memory is bounded whatever the number of identities: at most ``max_tallies`` are held, the least
recently used given back to the store (``TallyStore``: the engine, beside the session records) and
read again when their identity returns. The store also makes the counts outlive the process.
"""

from __future__ import annotations

import datetime
import logging
import math
import time
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Protocol

import anyio

from ..config.accounting import CPU_PER_DAY, CPU_PER_HOUR, INSTALLS_PER_DAY, RUNS_PER_MINUTE, QuotaLimits, QuotaSettings
from ..errors import OverQuota
from ..observability import metrics
from ..observability.logs import identity_hash
from .windows import Window

log = logging.getLogger(__name__)
Clock = Callable[[], float]
MAX_TALLIES = 4096
# The windows: (quota, length, step). Both CPU quotas count the same charges.
WINDOWS = ((RUNS_PER_MINUTE, 60.0, 5.0), (CPU_PER_HOUR, 3600.0, 60.0), (CPU_PER_DAY, 86400.0, 900.0),
           (INSTALLS_PER_DAY, 86400.0, 900.0))  # fmt: skip
SPANS = {RUNS_PER_MINUTE: "60 s", CPU_PER_HOUR: "hour", CPU_PER_DAY: "24 hours", INSTALLS_PER_DAY: "24 hours"}


class TallyStore(Protocol):
    """Where tallies go when they leave memory and when the server stops, and come back from."""

    async def load(self, key: str) -> list[str]:
        """Every stored state of this identity hash that is this server's to count (its own, and
        those of stopped servers it takes over)."""
        ...

    async def save(self, key: str, state: str) -> None:
        """Keep ``state`` as the identity's (an empty state: nothing to keep)."""
        ...


@dataclass(eq=False)
class Tally:
    windows: dict[str, Window] = field(default_factory=lambda: {q: Window(n, s) for q, n, s in WINDOWS})
    version: int = 0  # changes with every charge
    saved: int = 0  # the version the store holds

    @property
    def dirty(self) -> bool:
        return self.version != self.saved

    def charge(self, quota: str, now: float, amount: float) -> None:
        self.windows[quota].add(now, amount)
        self.version += 1

    def take_back(self, quota: str, now: float, amount: float) -> None:
        window = self.windows[quota]
        window.tidy(now)
        for index in sorted(window.buckets, reverse=True):  # the newest charge first
            taken = min(amount, window.buckets[index])
            window.buckets[index] -= taken
            amount -= taken
            if window.buckets[index] <= 0:
                del window.buckets[index]
            if amount <= 0:
                break
        self.version += 1

    def encode(self, now: float) -> str:
        parts = []
        for quota, window in self.windows.items():
            window.tidy(now)
            if not window.empty:
                parts.append(f"{quota}={window.encode()}")
        return ";".join(parts)

    def decode(self, state: str) -> None:
        for part in state.split(";"):
            quota, _, text = part.partition("=")
            if quota in self.windows:
                self.windows[quota].decode(text)


@dataclass(frozen=True)
class Standing:
    """Where an identity stands against one quota, for get_usage."""

    quota: str
    limit: float
    used: float
    window_s: float
    frees_in_s: float | None  # until what is counted now is all out of the window


def when(at: float, now: float) -> str:
    """``in 42 s (at 12:34:56 UTC)``: for a model, the wait; for a human, the time."""
    wait = max(0, math.ceil(at - now))
    if wait < 120:
        span = f"{wait} s"
    elif wait < 7200:
        span = f"{math.ceil(wait / 60)} min"
    else:
        hours, minutes = divmod(math.ceil(wait / 60), 60)
        span = f"{hours} h {minutes} min"
    clock = datetime.datetime.fromtimestamp(at, datetime.UTC).strftime("%Y-%m-%d %H:%M:%S")
    return f"in {span} (at {clock} UTC)"


class QuotaBook:
    def __init__(
        self,
        settings: QuotaSettings,
        *,
        clock: Clock = time.time,
        store: TallyStore | None = None,
        max_tallies: int = MAX_TALLIES,
    ) -> None:
        self.settings = settings
        self.clock = clock
        self.store = store
        self.max_tallies = max_tallies
        self._tallies: OrderedDict[str, Tally] = OrderedDict()  # by identity hash, least recently used first
        self._loading: dict[str, anyio.Event] = {}

    def limits(self, identity: str) -> QuotaLimits:
        return self.settings.limits_for(identity)

    def counts_cpu(self, identity: str) -> bool:
        limits = self.limits(identity)
        return bool(limits.cpu_s_per_hour or limits.cpu_s_per_day)

    def counted(self, identity: str) -> bool:
        limits = self.limits(identity)
        return any(getattr(limits, quota) for quota, _, _ in WINDOWS)

    # -- admission and charges ------------------------------------------------------------------------
    async def admit_run(self, identity: str) -> None:
        """Count a run that is about to start; ``OverQuota`` (nothing counted) past a quota."""
        if not self.counted(identity):
            return
        tally = await self._tally(identity)
        limits, now = self.limits(identity), self.clock()
        runs = tally.windows[RUNS_PER_MINUTE]
        if limits.runs_per_minute and runs.total(now) + 1 > limits.runs_per_minute:
            frees = runs.frees_at(now, runs.total(now) + 1 - limits.runs_per_minute)
            raise self._refuse(
                RUNS_PER_MINUTE,
                f"your identity started {runs.total(now):.0f} runs in the last 60 s, its quota is "
                f"{limits.runs_per_minute}; a run can start again {when(frees or now, now)}. Nothing was run",
                frees,
            )
        self._refuse_past_cpu(tally, limits, now, "runs are admitted again", "Nothing was run")
        tally.charge(RUNS_PER_MINUTE, now, 1)

    async def admit_call(self, identity: str) -> None:
        """A call that runs the identity's code or starts a container for it (a listing of its
        variables, a paused session resumed): ``OverQuota`` past a CPU quota, as a run would be."""
        if self.counts_cpu(identity):
            tally, now = await self._tally(identity), self.clock()
            self._refuse_past_cpu(
                tally, self.limits(identity), now,
                "calls that start a session's container or run its code are admitted again",
                "Nothing was started or run",
            )  # fmt: skip

    def _refuse_past_cpu(self, tally: Tally, limits: QuotaLimits, now: float, again: str, nothing: str) -> None:
        for quota in (CPU_PER_HOUR, CPU_PER_DAY):
            limit, window = getattr(limits, quota), tally.windows[quota]
            used = window.total(now)
            if limit and used >= limit:
                frees = window.frees_at(now, used - limit + 1e-6)
                raise self._refuse(
                    quota,
                    f"your identity's runs used {used:.1f} CPU seconds in the last {SPANS[quota]}, its quota is "
                    f"{limit:g}; {again} {when(frees or now, now)}. {nothing}",
                    frees,
                )

    async def over_cpu(self, identity: str) -> bool:
        """Whether ``identity`` is at or past a CPU quota now (its runs would be refused)."""
        if not self.counts_cpu(identity):
            return False
        tally, limits, now = await self._tally(identity), self.limits(identity), self.clock()
        return any(
            getattr(limits, quota) and tally.windows[quota].total(now) >= getattr(limits, quota)
            for quota in (CPU_PER_HOUR, CPU_PER_DAY)
        )

    def take_back_run(self, identity: str) -> None:
        """A run counted by ``admit_run`` that did not start after all (its session was busy, no
        container came): it counts no more."""
        tally = self._tallies.get(identity_hash(identity))
        if tally is not None:
            tally.take_back(RUNS_PER_MINUTE, self.clock(), 1)

    async def charge_cpu(self, identity: str, seconds: float) -> None:
        """What a run used, once it ended (both CPU windows)."""
        if seconds > 0 and self.counted(identity):
            tally, now = await self._tally(identity), self.clock()
            tally.charge(CPU_PER_HOUR, now, seconds)
            tally.charge(CPU_PER_DAY, now, seconds)

    async def admit_installs(self, identity: str, count: int) -> None:
        """Count ``count`` packages about to be installed, all or none; ``OverQuota`` past the quota."""
        limit = self.limits(identity).package_installs_per_day
        if count <= 0 or not limit:
            return
        tally, now = await self._tally(identity), self.clock()
        window = tally.windows[INSTALLS_PER_DAY]
        used = window.total(now)
        if used + count > limit:
            frees = window.frees_at(now, used + count - limit) if count <= limit else None
            later = f"it fits again {when(frees, now)}" if frees is not None else "ask for fewer packages"
            raise self._refuse(
                INSTALLS_PER_DAY,
                f"this install brings {count} packages and your identity installed {used:.0f} in the last 24 hours, "
                f"of a quota of {limit}; {later}. Nothing was installed or run",
                frees,
            )
        tally.charge(INSTALLS_PER_DAY, now, count)

    def _refuse(self, quota: str, said: str, frees: float | None) -> OverQuota:
        metrics.quota_refused(quota)
        window = next(length for name, length, _ in WINDOWS if name == quota)
        return OverQuota(f"quota {quota} reached: {said}", quota, window, frees)

    async def standing(self, identity: str) -> list[Standing]:
        """Each counted quota of ``identity``: its limit, what is used now, and when that is all out."""
        limits = self.limits(identity)
        if not self.counted(identity):
            return []
        tally, now = await self._tally(identity), self.clock()
        found = []
        for quota, length, _ in WINDOWS:
            window = tally.windows[quota]
            used = window.total(now)
            frees = window.frees_at(now, used) if used else None
            frees_in = None if frees is None else round(max(0.0, frees - now), 1)
            found.append(Standing(quota, getattr(limits, quota), round(used, 3), length, frees_in))
        return found

    # -- memory and the store ----------------------------------------------------------------------------
    async def _tally(self, identity: str) -> Tally:
        key = identity_hash(identity)
        while True:
            tally = self._tallies.get(key)
            if tally is not None:
                self._tallies.move_to_end(key)
                return tally
            loading = self._loading.get(key)
            if loading is None:
                break
            await loading.wait()
        self._loading[key] = loading = anyio.Event()
        try:
            tally = Tally()
            for state in await self.store.load(key) if self.store is not None else ():
                tally.decode(state)
            await self._make_room()
            self._tallies[key] = tally
            return tally
        finally:
            del self._loading[key]
            loading.set()

    async def _make_room(self) -> None:
        """Below ``max_tallies``: the least recently used go, each saved first if it changed."""
        while len(self._tallies) >= self.max_tallies:
            key, tally = next(iter(self._tallies.items()))
            if tally.dirty and self.store is not None:
                await self._save(key, tally)
            if self._tallies.get(key) is tally and not (tally.dirty and self.store is not None):
                del self._tallies[key]

    async def _save(self, key: str, tally: Tally) -> None:
        version = tally.version
        await self.store.save(key, tally.encode(self.clock())) if self.store is not None else None
        tally.saved = version

    async def save(self) -> int:
        """Keep every tally that changed since it was last kept; how many were. A failure is logged
        and tried again at the next save."""
        if self.store is None:
            return 0
        kept = 0
        for key, tally in list(self._tallies.items()):
            if tally.dirty:
                try:
                    await self._save(key, tally)
                    kept += 1
                except Exception as exc:  # noqa: BLE001 - the engine may be away; the counts stay in memory
                    log.warning("could not keep the quota counts of an identity: %s", exc)
        return kept

    async def keep_saving(self, every_s: float) -> None:
        """Save what changed every ``every_s`` (a timer, in the service's task group)."""
        while True:
            await anyio.sleep(every_s)
            await self.save()

    def __len__(self) -> int:
        return len(self._tallies)
