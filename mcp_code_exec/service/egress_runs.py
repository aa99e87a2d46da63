"""Egress in runs and sessions: a run's HTTP_PROXY in its options, its end told to the proxy, what
its result says of it; a session's reach, narrowed at ``new_session`` or while it lives (never
widened). The keeper (``keeper``) keeps what a session narrowed to in its record, and
``session_contents`` gives it to its forks.

Without ``[egress]`` every method here is a no-op: runs carry no proxy and sessions no reach.
"""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence

from anyio.abc import TaskGroup

from ..config.egress import EgressSettings
from ..egress import reach as reaches
from ..egress.service import Egress
from ..egress.tokens import run_grant, session_grant
from ..errors import ReachRefused
from ..models import Usage
from ..protocol import messages as wire
from ..runtime.base import LABEL_INSTANCE, ContainerEngine
from ..sandbox.container import Sandbox
from .run_registry import Run
from .sessions import Session


class EgressRuns:
    def __init__(self, egress: Egress | None) -> None:
        self.egress = egress
        self.volume = None if egress is None else egress.volume  # sandboxes mount it read-only

    @classmethod
    def made(
        cls,
        settings: EgressSettings,
        runtime: str | None,
        session_lifetime_s: float,
        engine: ContainerEngine,
        labels: dict[str, str],
        identities: Collection[str] | None,
        max_sandboxes: int,
    ) -> EgressRuns:
        """``labels``: the service's (its proxy and the proxy's volume are swept as its containers are);
        ``runtime``: the sandboxes'; ``session_lifetime_s``: the longest a grant may have to last;
        ``max_sandboxes``: the most the server may run at once (the proxy's connections are sized for them)."""
        if not settings.enabled:
            return cls(None)
        egress = Egress(
            settings,
            engine,
            labels=labels,
            instance=labels[LABEL_INSTANCE],
            runtime=runtime,
            session_lifetime_s=session_lifetime_s,
            identities=identities,
            max_sandboxes=max_sandboxes,
        )
        return cls(egress)

    async def start(self, task_group: TaskGroup) -> None:
        if self.egress is not None:
            await self.egress.start(task_group)

    async def stop(self) -> None:
        if self.egress is not None:
            await self.egress.stop()

    # -- runs -----------------------------------------------------------------------------------------
    def stateless(self, run: Run, options: wire.RunOptions, sandbox: Sandbox) -> wire.RunOptions:
        if self.egress is None:
            return options
        key = sandbox.egress_key
        _, proxy = self.egress.run_proxy(run.owner, run.id, run.timeout_s, key)
        return options.model_copy(update={"egress_proxy": proxy, "egress_key": key})

    def stateless_ended(self, run: Run) -> list[str]:
        """The run's grant ends (its connections are cut); what its result says of its egress."""
        if self.egress is None:
            return []
        return self.egress.run_ended(run_grant(run.id), run.timeout_s)

    def session(self, session: Session, options: wire.RunOptions, sandbox: Sandbox) -> wire.RunOptions:
        if self.egress is None:
            return options
        key = sandbox.egress_key
        _, proxy = self.egress.session_proxy(session.id, session.owner, self.reach_of(session), key)
        return options.model_copy(update={"egress_proxy": proxy, "egress_key": key})

    def session_notes(self, session: Session) -> list[str]:
        if self.egress is None:
            return []
        return self.egress.session_notes(session_grant(session.id))

    def meters(self) -> list[Callable[[Run, Usage], None]]:
        """The accounting's meter of ``egress_bytes`` (none without egress)."""
        return [] if self.egress is None else [self.meter]

    def meter(self, run: Run, usage: Usage) -> None:
        """``usage.egress_bytes``: the bytes the proxy recorded for the run's grant (called as the run
        ends, after its grant's notes were taken)."""
        if self.egress is not None:
            grant = run_grant(run.id) if run.session_id is None else session_grant(run.session_id)
            usage.egress_bytes = self.egress.accounting.bytes_of(grant)

    # -- sessions -------------------------------------------------------------------------------------
    def reach_of(self, session: Session) -> reaches.Reach:
        assert self.egress is not None
        return reaches.kept(self.egress.settings, session.owner, session.egress)

    def shown(self, session: Session) -> list[str] | None:
        """The session's reach as its ``SessionInfo`` shows it (None: the server has no egress)."""
        return None if self.egress is None else list(self.reach_of(session))

    def at_start(self, session: Session, wanted: Sequence[str] | None) -> None:
        """A new session's reach: its owner's, or less (``wanted``; an entry it may not reach is refused)."""
        if wanted is None:
            return
        if self.egress is None:
            raise ReachRefused("this server has no egress ([egress] allow is empty): a session reaches nothing")
        session.narrow_egress(reaches.narrowed(self.egress.reach_of(session.owner), wanted))

    async def restrict(self, session: Session, wanted: Sequence[str]) -> list[str]:
        """Cut the session's reach down to ``wanted`` now: tunnels outside it are cut, and its forks
        from now on inherit it (its record is the keeper's to write again)."""
        if self.egress is None:
            raise ReachRefused("this server has no egress ([egress] allow is empty): the session reaches nothing")
        narrowed = reaches.narrowed(self.reach_of(session), wanted)
        session.narrow_egress(narrowed)
        await self.egress.narrow(session.id, narrowed)
        return list(narrowed)

    def closed(self, session: Session) -> None:
        if self.egress is not None:
            self.egress.session_closed(session.id)

    def describe(self, owner: str) -> str:
        """What run_python's description says of the caller's egress ("" without egress)."""
        if self.egress is None:
            return ""
        return (
            "\nEgress: the code has no network of its own, but HTTP and HTTPS requests (requests, urllib, httpx, "
            "pip, curl, git: they go through the server's proxy by themselves) reach these hosts: "
            + reaches.describe(self.egress.reach_of(owner))
            + ". Anything else is refused with a 403 naming the host. A session may narrow its reach "
            "(new_session's egress, restrict_egress), never widen it.\n"
        )
