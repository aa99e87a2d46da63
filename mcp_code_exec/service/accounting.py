"""What the service counts and records: each run's usage, each identity's quotas, the audit log.

A run's usage is put together when it ends: the sandbox's figures (CPU, peak memory, bytes
written, which ``sandbox.container`` decodes from the agent's account), the server's own (wall
time from admission, packages it copied in, code mode's calls), and what ``meters`` add (the
egress proxy's bytes). The run's CPU is then charged to its identity, its session's totals grow,
and the audit log gets its ``run`` line.

A session's container also uses CPU between its runs (a thread or a process a cell left running,
the agent writing its snapshot): ``settle`` charges it, from the container's CPU total as the
engine's host counts it (a figure nothing in the sandbox can change) less what was charged for
that container already, every ``SETTLE_S`` while it is idle and when it is paused, closed, replaced
or let go at the server's end (for every session: its totals say it), and before each of its runs
where its owner has a CPU quota (only there: the reading costs the call about a millisecond).

An identity a charge takes to or past a CPU quota has its idle sessions paused by the keeper, told
through ``owners_over_cpu``: their runs would be refused, and what a cell left running in them would
otherwise burn on until they paused for being idle. A session a call holds is left to it (the next
call is refused); each resumes as any paused one at its next call, once the quota frees.

The audit log's last line (its seq and hash) is kept on the engine beside the quota counts (a
ledger of its own, every ``SAVE_S`` and at the end), and given back to the log at the next start,
which then finds lines cut from the file's end meanwhile (``ledger.audit``).

Egress fills ``egress_bytes`` with a meter (``meters``, given by ``egress_runs.EgressRuns.meters``):
``fn(run, usage)`` sets ``usage.egress_bytes`` from the proxy's account of the run's grant, before
the usage is charged and recorded.
"""

from __future__ import annotations

import hashlib
import logging
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from typing import TYPE_CHECKING, Any

import anyio
from anyio.abc import TaskGroup

from ..config.accounting import AuditSettings, QuotaSettings
from ..errors import OverQuota
from ..ledger.audit import AuditLog
from ..ledger.audit_head import KeptHead
from ..ledger.audit_logger import attach, detach
from ..ledger.quotas import Clock, QuotaBook, TallyStore
from ..models import ErrorInfo, QuotaUse, RunResult, SessionUsage, Usage, UsageReport
from ..observability.logs import identity_hash, logged_id
from ..sandbox.ledgers import QuotaLedgers
from ..sandbox.records import SessionRecords

if TYPE_CHECKING:
    from ..sandbox.container import Sandbox
    from .run_registry import Run
    from .sessions import Session

log = logging.getLogger(__name__)
SAVE_S = 2.0  # how often changed quota counts are kept on the engine (a kill loses at most this)
CHARGE_WAIT_S = 10.0
SETTLE_S = 10.0  # how often an idle session's container's CPU is read and charged
READ_S = 10.0  # the most a reading of a container's CPU may take
CPU_MARGIN, CPU_SLACK_S = 1.1, 0.25  # a run's CPU figure beyond its wall time at the CPU limit is cut to this
SMALL_S = 0.1  # less CPU than this between runs waits for the next settlement (no audit line each time)
STOP_S = 15.0  # how long the last save of the counts may take at the service's end
Meter = Callable[["Run", Usage], None]


def code_digest(code: str) -> tuple[str, int]:
    data = code.encode("utf-8", "surrogatepass")
    return hashlib.sha256(data).hexdigest(), len(data)


class Accounting:
    def __init__(
        self,
        quotas: QuotaSettings,
        audit: AuditSettings,
        store: TallyStore | None = None,
        clock: Clock = time.time,
        cpus: float = 1.0,
        heads: TallyStore | None = None,
    ) -> None:
        """``cpus``: a container's CPU limit, the most CPU a run can use in a second of its wall time;
        ``heads``: where the audit log's last line is kept (away from its file)."""
        self.quotas = QuotaBook(quotas, clock=clock, store=store)
        self.cpus = cpus
        self.audit = AuditLog(audit, clock=clock)
        self.head = KeptHead(heads, self.audit) if heads is not None and self.audit.enabled else None
        self.meters: list[Meter] = []
        self.pass_s = 0.0  # how long the timer's last pass over the sessions took
        self._sessions: Callable[[], list[Session]] = list
        self._over_cpu: set[str] = set()  # identities a charge took past a CPU quota, not yet told
        self._over_cpu_found = anyio.Event()

    async def start(self, task_group: TaskGroup, sessions: Callable[[], list[Session]] = list) -> None:
        """Open the audit log (given its last line as kept), keep the quota counts and that line on the
        engine, and settle the live ``sessions``' CPU (in the service's task group)."""
        self._sessions = sessions
        task_group.start_soon(self.keep_settling, sessions)
        if self.head is not None:
            self.audit.kept = await self.head.load()
        await anyio.to_thread.run_sync(lambda: self.audit.open(background=True))
        attach(self.audit)
        if self.quotas.store is not None and self.quotas.settings.counted:
            task_group.start_soon(self.quotas.keep_saving, SAVE_S)
        if self.head is not None:
            task_group.start_soon(self.head.keep_saving)

    @classmethod
    def on_engine(
        cls, quotas: QuotaSettings, audit: AuditSettings, records: SessionRecords, clock: Clock, cpus: float = 1.0
    ) -> Accounting:
        """Its counts kept on the engine, beside the session records (where any quota counts over time)."""
        store = QuotaLedgers(records.engine, records.instance, records.scope, clock) if quotas.counted else None
        heads = QuotaLedgers(records.engine, records.instance, records.scope, clock) if audit.file else None
        return cls(quotas, audit, store, clock, cpus, heads)

    @staticmethod
    async def sweep(quotas: QuotaSettings, records: SessionRecords, now: float) -> None:
        """At start: the quota ledgers that count nothing any more go (none are read where no quota counts)."""
        if quotas.counted:
            await QuotaLedgers(records.engine, records.instance, records.scope, lambda: now).sweep()

    def health(self) -> dict[str, Any]:
        """For /healthz: the audit log's state, where there is one."""
        audit = self.audit.status()
        return {} if audit is None else {"audit": audit}

    async def stop(self) -> None:
        with anyio.move_on_after(STOP_S):  # the engine may not answer: the counts kept last stand
            await self.quotas.save()
        detach(self.audit)
        await anyio.to_thread.run_sync(self.audit.close)  # waits for the lines still to be written
        if self.head is not None:
            with anyio.move_on_after(STOP_S):
                await self.head.save()

    # -- admission ---------------------------------------------------------------------------------------
    @asynccontextmanager
    async def admitted(self, owner: str) -> AsyncIterator[None]:
        """Count a run (``AuditUnavailable``, a required log that cannot be written, or ``OverQuota``
        first); taken back when the block fails (its session was busy, no container came)."""
        self.audit.require()
        await self.quotas.admit_run(owner)
        try:
            yield
        except BaseException:
            self.quotas.take_back_run(owner)
            raise

    async def admit_installs(self, owner: str, count: int) -> ErrorInfo | None:
        """Count ``count`` package installs; past the quota, the run's error (nothing is copied in)."""
        try:
            await self.quotas.admit_installs(owner, count)
        except OverQuota as exc:
            return ErrorInfo(type="OverQuota", message=str(exc))
        return None

    async def report(self, owner: str, session: Session | None = None) -> UsageReport:
        """The owner's quotas counted over time, and ``session``'s totals."""
        quotas = [QuotaUse(**vars(each)) for each in await self.quotas.standing(owner)]
        if session is None:
            return UsageReport(quotas=quotas)
        totals = SessionUsage(session_id=session.id, since=session.usage_since, **session.usage.model_dump())
        return UsageReport(quotas=quotas, session=totals)

    # -- the end of a run ----------------------------------------------------------------------------------
    def charged_cpu(self, usage: Usage, host_s: float | None = None) -> float:
        """The CPU seconds a run is charged: what the sandbox measured (at most what a run could have
        used: a figure from a sandbox never buys CPU later), or, where it gave no figure (its container
        died or stopped answering, which a run can bring about by filling its memory), the most it
        could have used: its wall time at the container's CPU limit. Losing the figure never pays.
        ``host_s``: what the host counted of the run's container meanwhile, where it was read: the
        charge is never less."""
        if usage.cpu_user_s is None and usage.cpu_system_s is None:
            measured = (usage.wall_s or 0.0) * self.cpus
        else:  # the margin: the limit holds per scheduling period, a wall clock is read on either side
            measured = min(usage.cpu_s, (usage.wall_s or 0.0) * self.cpus * CPU_MARGIN + CPU_SLACK_S)
        return max(measured, host_s or 0.0)

    async def container_cpu(self, owner: str, sandbox: Sandbox) -> float | None:
        """A stateless run's container's CPU total as the host counts it, where ``owner`` has a CPU quota
        (read before and after the run: ``run_ended``'s ``host_s``), 0 where it gave no figure (before
        the run: all the container used counts then; after it: the sandbox's own figure does); None
        for an owner without a CPU quota (nothing is read: the run's path stays as it was)."""
        if not self.quotas.counts_cpu(owner):
            return None
        try:
            with anyio.fail_after(READ_S):
                return await sandbox.engine.cpu_usage_s(sandbox.container_id) or 0.0
        except Exception as exc:  # noqa: BLE001 - the engine may be away
            log.warning("a stateless container's CPU could not be read: %s", exc)
            return 0.0

    async def container_cpu_since(self, before: float | None, owner: str, sandbox: Sandbox) -> float | None:
        """What the host counted of a stateless run's container since ``before`` (``container_cpu``'s,
        read as the run began: None, nothing is read); read before the container goes back to its pool."""
        if before is None:
            return None
        with anyio.CancelScope(shield=True):  # bounded (``READ_S``): the container's release waits for it
            after = await self.container_cpu(owner, sandbox)
        return max(0.0, (after or 0.0) - before)

    async def run_ended(
        self, run: Run, result: RunResult, session: Session | None = None, host_s: float | None = None
    ) -> Usage:
        """Put the run's usage together, charge it, add it to its session's totals and record it;
        ``host_s``: what the host counted of a stateless run's container (``container_cpu``)."""
        measured = result.usage or Usage()
        usage = measured.model_copy(
            update={
                "wall_s": round(max(0.0, (run.finished_at or time.monotonic()) - run.started), 3),
                "packages_installed": run.packages_installed,
                "tool_calls": run.tool_budget.calls if run.tool_budget is not None else 0,
            }
        )
        for meter in self.meters:
            try:
                meter(run, usage)
            except Exception:
                log.warning("a usage meter failed", exc_info=True)
        charged = self.charged_cpu(usage, host_s)
        if session is not None:
            self._ran_in(session, charged, lost=usage.cpu_user_s is None and usage.cpu_system_s is None)
        await self.charge(run.owner, charged, "run")
        if session is not None:
            session.usage.add(usage)
        self.audit.record(
            "run",
            identity=run.owner,
            session=run.session_id,
            run=run.id,
            kind=run.kind,
            code_sha256=run.code_sha256,
            code_bytes=run.code_bytes,
            status=result.status,
            usage=usage.model_dump(exclude_none=True),
            **({} if abs(charged - usage.cpu_s) < 1e-6 else {"cpu_charged_s": round(charged, 6)}),
        )
        return usage

    async def charge(self, owner: str, seconds: float, what: str) -> bool:
        """Charge CPU to ``owner``'s quotas; a charge that cannot be made (the counts could not be read
        from the engine in time, or the engine failed making room for them) is logged, with the
        identity's hash, and the call that made it goes on."""
        try:
            with anyio.fail_after(CHARGE_WAIT_S):  # the counts may have to be read from the engine first
                await self.quotas.charge_cpu(owner, seconds)
                over = await self.quotas.over_cpu(owner)
        except Exception as exc:  # noqa: BLE001 - a run's answer outlives its accounting
            log.warning(
                "a %s CPU charge of %.3f s to identity %s was dropped: %s",
                what, seconds, identity_hash(owner), str(exc) or type(exc).__name__,
            )  # fmt: skip
            return False
        if over:
            self.stop_burning(owner)
        return True

    def stop_burning(self, owner: str) -> None:
        """``owner`` is past a CPU quota: the keeper pauses its idle sessions (``owners_over_cpu``), in
        the background (a charge is made under a call or a pause, which must not wait for others)."""
        self._over_cpu.add(owner)
        self._over_cpu_found.set()

    async def owners_over_cpu(self) -> set[str]:
        """The identities a charge took past a CPU quota since the last asking (waits for one)."""
        await self._over_cpu_found.wait()
        self._over_cpu_found = anyio.Event()
        owners, self._over_cpu = self._over_cpu, set()
        return owners

    # -- a session's CPU between its runs ------------------------------------------------------------------
    def _ran_in(self, session: Session, charged: float, *, lost: bool) -> None:
        """A run of ``session`` ended, charged ``charged``: that counts as charged for its container."""
        sandbox = session.sandbox
        if sandbox is None or (lost and not sandbox.alive):  # died with the run, charged all it could use
            session.cpu_forget()
            return
        session.cpu_ran(sandbox.container_id, charged)

    async def settle(
        self, session: Session, *, final: bool = False, unused: bool = False, before_call: bool = False
    ) -> None:
        """Charge ``session``'s owner for the CPU its container used outside its runs: the container's
        total less what was charged for it. The first figure of a container is where it starts (no code
        has run in it yet); ``final``: the container is about to go (any amount counts, and one that can
        no longer be read, or was never read, is charged the most it could have used since its last
        figure, at most ``unread_s()`` at the CPU limit). The caller makes sure no run of the session is going, or, with
        ``unused``, the figure is let go when a call came to use the session while it was read.
        ``before_call``: read only where its owner has a CPU quota (the call waits for the reading)."""
        sandbox = session.sandbox
        if sandbox is None or not session.owner:
            return
        if before_call and not self.quotas.counts_cpu(session.owner):
            return
        try:
            with anyio.fail_after(READ_S):
                total = await sandbox.engine.cpu_usage_s(sandbox.container_id)
        except Exception as exc:  # noqa: BLE001 - the engine may be away: the next settlement reads again
            log.warning("session %s: its CPU could not be read: %s", logged_id(session.id), exc)
            total = None
        if unused and (session.busy or session.active_run is not None):
            return  # it may hold some of a run's CPU, which the run is charged itself
        if session.cpu_container != sandbox.container_id and total is not None:
            session.cpu_started(sandbox.container_id, total)
            return
        if total is None or session.cpu_container != sandbox.container_id:
            if not final:
                return  # never read, gone at its end: charged the unread span below all the same
            idle, why = min(self.unread_s(), max(0.0, time.monotonic() - session.cpu_read_at)) * self.cpus, "unread"
        else:
            idle, why = session.cpu_read(total), "idle"
            if idle < (1e-6 if final else SMALL_S):
                return
        session.cpu_settled(idle, final=final)  # before any await: a settlement racing this one sees it charged
        session.usage.idle_cpu_s = round(session.usage.idle_cpu_s + idle, 3)
        await self.charge(session.owner, idle, "between-runs")
        self.audit.record("idle_cpu", identity=session.owner, session=session.id, cpu_s=round(idle, 6), read=why)

    def unread_s(self) -> float:
        """The most a container can have gone unread: a timer's wait and its last pass (a pass reads the
        sessions one after another), at least ``READ_S`` for the reading that failed."""
        return SETTLE_S + max(READ_S, self.pass_s)

    async def keep_settling(self, sessions: Callable[[], list[Session]]) -> None:
        """Every ``SETTLE_S``, settle each live session no call holds (a timer, in the service's task group)."""
        while True:
            await anyio.sleep(SETTLE_S)
            began = time.monotonic()
            for session in sessions():
                # Not holding the session: a pause or a call must never find it busy for this.
                if session.sandbox is not None and not session.busy and not session.lock.locked():
                    await self.settle(session, unused=True)
            self.pass_s = time.monotonic() - began
