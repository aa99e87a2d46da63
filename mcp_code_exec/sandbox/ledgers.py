"""Quota ledgers: an identity's quota counts kept on the engine, beside the session records.

The counts must outlive the server (a restart must not give every identity a fresh hour), and a
server's state is kept where its sessions' is: on the engine, whose volumes outlive the process
and are there for the next server wherever it starts. A ledger is an empty volume whose labels hold
one identity's counts (``ledger.quotas.Tally``, a few hundred bytes), the hash of the identity, the
scope, and which server holds it. Docker cannot relabel a volume: a save makes a new ledger and
removes the one before, so there is always one whole ledger (two, for a moment).

A server reads an identity's ledger when that identity first calls (``load``), never all of them:
it holds in memory only the identities it serves. The ledgers of a stopped server of its scope
are taken over then, as records are (written again as its own, then removed); those of a live
server are that server's to count. At start, ledgers with nothing left in any window go
(``sweep``). With several engines, a ledger lives on one of them and is read from wherever it is.
"""

from __future__ import annotations

import logging
import secrets
import time
from collections import OrderedDict
from collections.abc import Callable, Collection

import anyio

from ..errors import SandboxError
from ..runtime.base import (
    LABEL_CREATED,
    LABEL_IDENTITY,
    LABEL_KIND,
    LABEL_OWNER,
    LABEL_PREFIX,
    LABEL_SCOPE,
    ContainerEngine,
    VolumeRecord,
)
from .ownership import LEDGER_KIND, VOLUME_PREFIX, owner_alive, owner_token
from .records import DEFAULT_SCOPE, RUNNING_HERE

log = logging.getLogger(__name__)
LEDGER_PREFIX = VOLUME_PREFIX + "quota-"
LABEL_STATE = f"{LABEL_PREFIX}.quota-state"
LABEL_HOLDER = f"{LABEL_PREFIX}.ledger-instance"  # not ``instance``: a server's own sweep must leave it
LONGEST_S = 86400.0 + 900.0  # the longest window and its step: a ledger saved before that counts nothing
NAMES_KEPT = 8192


class QuotaLedgers:
    """``ledger.quotas.TallyStore`` on an engine, for one server (``instance``) of one scope."""

    def __init__(
        self, engine: ContainerEngine, instance: str, scope: str = DEFAULT_SCOPE, clock: Callable[[], float] = time.time
    ) -> None:
        """``clock``: the wall clock the counts are kept by (the quota book's)."""
        self.engine = engine
        self.clock = clock
        self.instance = instance
        self.scope = scope
        self._current: OrderedDict[str, str] = OrderedDict()  # identity hash -> our ledger's name
        self._lock = anyio.Lock()

    def _labels(self, key: str, state: str) -> dict[str, str]:
        return {
            LABEL_OWNER: owner_token(),
            LABEL_HOLDER: self.instance,
            LABEL_KIND: LEDGER_KIND,
            LABEL_SCOPE: self.scope,
            LABEL_IDENTITY: key,
            LABEL_CREATED: f"{self.clock():.3f}",
            LABEL_STATE: state,
        }

    def _held_live(self, volume: VolumeRecord) -> bool:
        """Held by a server that is running (this one included)."""
        holder = volume.labels.get(LABEL_OWNER, "")
        if holder == owner_token():
            return volume.labels.get(LABEL_HOLDER) in RUNNING_HERE
        return owner_alive(holder)

    async def load(self, key: str) -> list[str]:
        async with self._lock:
            newest: dict[tuple[str, str], VolumeRecord] = {}  # per server holding one: its last save
            stale: list[str] = []
            for volume in await self.engine.volumes(f"{LABEL_IDENTITY}={key}"):
                labels = volume.labels
                if labels.get(LABEL_KIND) != LEDGER_KIND or labels.get(LABEL_SCOPE, DEFAULT_SCOPE) != self.scope:
                    continue
                if self._held_live(volume) and not self._ours(volume):
                    continue  # a running server's counts are its own
                holder = (labels.get(LABEL_OWNER, ""), labels.get(LABEL_HOLDER, ""))
                if holder in newest and saved_at(newest[holder]) >= saved_at(volume):
                    stale.append(volume.name)  # a save whose old ledger was not removed: counted once
                    continue
                if holder in newest:
                    stale.append(newest[holder].name)
                newest[holder] = volume
            states = [volume.labels.get(LABEL_STATE, "") for volume in newest.values()]
            adopted = [volume.name for volume in newest.values() if not self._ours(volume)]
            if adopted or stale:  # written again as ours before the others go: never lost, never counted twice
                merged = ";".join(state for state in states if state)
                await self._write(key, merged, [volume.name for volume in newest.values()] + stale)
                return [merged]
            if newest:
                self._remember(key, next(iter(newest.values())).name)
            return states

    def _ours(self, volume: VolumeRecord) -> bool:
        return volume.labels.get(LABEL_OWNER) == owner_token() and volume.labels.get(LABEL_HOLDER) == self.instance

    async def save(self, key: str, state: str) -> None:
        async with self._lock:
            before = [self._current[key]] if key in self._current else []
            await self._write(key, state, before)

    async def _write(self, key: str, state: str, replaced: list[str]) -> None:
        """Make the new ledger (none for an empty state), then remove ``replaced``."""
        if state:
            name = LEDGER_PREFIX + secrets.token_hex(8)
            await self.engine.create_volume(name, self._labels(key, state))
            self._remember(key, name)
        else:
            self._current.pop(key, None)
        for old in replaced:
            try:
                await self.engine.remove_volume(old)
            except SandboxError as exc:  # counted twice at worst, until the next start's sweep
                log.warning("could not remove an old quota ledger %s: %s", old, exc)

    def _remember(self, key: str, name: str) -> None:
        self._current[key] = name
        self._current.move_to_end(key)
        while len(self._current) > NAMES_KEPT:  # one forgotten here is found again by its next load
            self._current.popitem(last=False)

    async def sweep(self, now: float | None = None) -> int:
        """Remove ledgers that count nothing any more (saved over a day ago), or are not ledgers."""
        now = self.clock() if now is None else now

        def spent(volume: VolumeRecord) -> bool:
            return now - saved_at(volume) >= LONGEST_S or not volume.name.startswith(LEDGER_PREFIX)

        return await _remove_ledgers(self.engine, spent, "a spent quota ledger")


async def remove_scopes(engine: ContainerEngine, scopes: Collection[str]) -> int:
    """Remove every ledger of ``scopes``, whoever holds it (for a scope nobody serves again: the
    bench's own); how many went."""
    return await _remove_ledgers(engine, lambda volume: volume.labels.get(LABEL_SCOPE) in scopes, "the quota ledger")


async def _remove_ledgers(engine: ContainerEngine, doomed: Callable[[VolumeRecord], bool], what: str) -> int:
    """Remove the ledgers ``doomed`` picks, each on its own (one that cannot go is logged); how many went."""
    removed = 0
    for volume in await engine.volumes(f"{LABEL_KIND}={LEDGER_KIND}"):
        if not doomed(volume):
            continue
        try:
            await engine.remove_volume(volume.name)
            removed += 1
        except SandboxError as exc:
            log.warning("could not remove %s %s: %s", what, volume.name, exc)
    return removed


def saved_at(volume: VolumeRecord) -> float:
    try:
        return float(volume.labels.get(LABEL_CREATED, ""))
    except ValueError:
        return 0.0
