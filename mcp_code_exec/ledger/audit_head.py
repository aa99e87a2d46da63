"""The audit log's last line (its seq and hash), kept away from its file: lines cut from the file's
end while no server ran are found at the next start (``audit.AuditLog.kept``).

It is kept in a ``quotas.TallyStore`` (on the engine, beside the quota counts: a ledger of its own,
keyed by the log's path), saved every few seconds and at the server's end.
"""

from __future__ import annotations

import logging

import anyio

from ..observability.logs import identity_hash
from .audit import AuditLog
from .quotas import TallyStore

log = logging.getLogger(__name__)
READ_S = 10.0  # the most reading the kept line may take at a start (past it, the log opens unchecked)
SAVE_S = 2.0


class KeptHead:
    def __init__(self, store: TallyStore, audit: AuditLog) -> None:
        self.store = store
        self.audit = audit
        self.key = identity_hash(f"audit-log:{audit.path}")
        self.saved: tuple[int, str] | None = None

    async def load(self) -> tuple[int, str] | None:
        """The furthest last line kept for this log (by this scope's servers); None if none was, or the
        engine did not answer in time (logged: the check is skipped this once)."""
        try:
            with anyio.fail_after(READ_S):
                states = await self.store.load(self.key)
        except Exception as exc:  # noqa: BLE001 - the log opens all the same
            log.warning("the audit log's last line kept on the engine could not be read: %s", exc)
            return None
        found = []
        for part in ";".join(states).split(";"):
            seq, _, sealed = part.partition(":")
            if seq.isdigit() and len(sealed) == 64:
                found.append((int(seq), sealed))
        return max(found, default=None)

    async def save(self) -> None:
        last = self.audit.last
        if last is None or last == self.saved:
            return
        try:
            await self.store.save(self.key, f"{last[0]}:{last[1]}")
            self.saved = last
        except Exception as exc:  # noqa: BLE001 - the engine may be away: tried again at the next save
            log.warning("the audit log's last line could not be kept on the engine: %s", exc)

    async def keep_saving(self) -> None:
        """Save it when it changed, every ``SAVE_S`` (a timer, in the service's task group)."""
        while True:
            await anyio.sleep(SAVE_S)
            await self.save()
