"""The members of a ``ClusterEngine``: what each holds, and whether it is in (health checks).

A member is in once it answered a ping within ``timeout_s`` and was admitted: same machine
architecture as the others, and the ``admit`` hook passed (the service's: the sandbox image is
there and current; what dead servers left there is swept). It is out from the first ping or call
that finds it not answering, until it answers and is admitted again. ``watch`` checks every
member every ``interval_s``; ``on_change`` hooks run when a member comes in.
"""

from __future__ import annotations

import logging
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import anyio

from ..errors import EngineError, EngineUnavailable, ImageMissing, SandboxError
from .base import ContainerEngine

log = logging.getLogger(__name__)
Connect = Callable[[], Awaitable[ContainerEngine]]
Admit = Callable[[ContainerEngine], Awaitable[None]]
OUT = (EngineUnavailable, ImageMissing)  # a member's failures that take it out (not a container's)
SESSION = "session"


@dataclass(eq=False)
class Member:
    """One engine of the cluster and what this server keeps there."""

    name: str
    connect: Connect  # makes the engine's client (once; again after a failed attempt)
    capacity: float = 1.0
    engine: ContainerEngine | None = None
    up: bool = False
    reason: str = "not checked yet"  # why it is out (for logs and doctor; may name its URL)
    error: SandboxError | None = None
    containers: dict[str, str] = field(default_factory=dict)  # our live containers there: id -> kind
    volumes: set[str] = field(default_factory=set)  # our volumes there (sessions and their spares)
    starting: Counter[str] = field(default_factory=Counter)  # placements under way, by kind
    moving: set[str] = field(default_factory=set)  # containers picked to move elsewhere (not counted)
    connecting: anyio.Lock = field(default_factory=anyio.Lock)  # one client, whoever asks first

    def count(self, kind: str) -> int:
        """Containers of ``kind`` here (sessions: volumes), those being placed here included."""
        leaving = sum(1 for container_id in self.moving if self.containers.get(container_id) == kind)
        here = len(self.volumes) if kind == SESSION else sum(1 for each in self.containers.values() if each == kind)
        return here - leaving + self.starting[kind]

    def share(self, kind: str) -> float:
        return self.count(kind) / self.capacity

    def load(self) -> float:
        return (len(self.containers) + len(self.volumes)) / self.capacity

    def figures(self) -> dict[str, Any]:
        kinds = Counter(self.containers.values())
        return {
            "name": self.name,
            "up": self.up,
            "capacity": self.capacity,
            "stateless": kinds["stateless"],
            "session_containers": kinds[SESSION],
            "volumes": len(self.volumes),
        }


class MemberHealth:
    """Health checks and admission of a cluster's members (a ``ClusterEngine`` holds one as ``health``)."""

    def __init__(
        self,
        members: Sequence[Member],
        *,
        admit: Admit | None,
        interval_s: float,
        timeout_s: float,
        admit_timeout_s: float,
    ) -> None:
        if not members:
            raise EngineError("a cluster needs at least one engine")
        self.members = list(members)
        self.admit = admit
        self.interval_s = interval_s
        self.timeout_s = timeout_s
        self.admit_timeout_s = admit_timeout_s
        self.machine: str | None = None  # the members' architecture, from the first one admitted
        self.on_change: list[Callable[[], None]] = []  # run when a member comes in or goes out
        self._change = anyio.Event()  # set (and renewed) at each of those

    def up(self) -> list[Member]:
        return [member for member in self.members if member.up and member.engine is not None]

    def none_in(self, *, why: bool = False) -> SandboxError:
        """The error for "no member can take this": the image's, if that is what keeps them out.
        Each one's reason (which may hold its address) only with ``why``: the operator's start-up
        error; callers hear engine names, the log has the rest."""
        if why:
            out = "; ".join(f"{member.name}: {member.reason}" for member in self.members)
        else:
            out = ", ".join(member.name for member in self.members if not member.up) + " out; see the server's log"
        if any(isinstance(member.error, ImageMissing) for member in self.members):
            return ImageMissing(f"no engine of the cluster can run sandboxes ({out})")
        return EngineUnavailable(f"no engine of the cluster answers ({out})")

    def out(self, member: Member, error: SandboxError) -> None:
        """Take a member out: nothing new goes there; its containers count as lost (their ids
        still lead there, for removal once it answers again)."""
        was_up = member.up
        if was_up or member.reason != str(error):
            log.warning("engine %s is out: %s", member.name, error)
        member.up = False
        member.error = error
        member.reason = str(error)
        member.containers.clear()
        member.moving.clear()
        if was_up:
            self._changed()

    def _changed(self) -> None:
        self._change.set()
        self._change = anyio.Event()
        for hook in list(self.on_change):
            hook()

    async def wait_for(self, condition: Callable[[], bool], timeout_s: float) -> None:
        """Until ``condition()`` holds (checked whenever a member comes in or goes out);
        TimeoutError past the bound."""
        with anyio.fail_after(timeout_s):
            while not condition():
                await self._change.wait()

    async def check(self, member: Member, *, admit: bool = True) -> bool:
        """Ping a member (connecting first if need be), within ``timeout_s``; admit it when it
        answers and was out (unless ``admit`` is False). Whether it answered."""
        try:
            with anyio.fail_after(self.timeout_s):
                async with member.connecting:
                    if member.engine is None:
                        member.engine = await member.connect()
                await member.engine.ping()
        except TimeoutError:
            self.out(member, EngineUnavailable(f"no answer within {self.timeout_s:g} s"))
            return False
        except SandboxError as exc:
            self.out(member, exc)
            return False
        if not member.up and admit:
            await self._admit(member)
        return True

    async def _admit(self, member: Member) -> None:
        assert member.engine is not None
        try:
            with anyio.fail_after(self.admit_timeout_s):
                machine = await member.engine.architecture()
                self.machine = self.machine or machine
                if machine != self.machine:
                    raise EngineError(f"it runs {machine} and the others {self.machine}: one image cannot serve both")
                if self.admit is not None:
                    await self.admit(member.engine)
        except TimeoutError:
            self.out(member, EngineUnavailable(f"its admission took over {self.admit_timeout_s:g} s"))
            return
        except SandboxError as exc:
            self.out(member, exc)
            return
        member.up, member.error, member.reason = True, None, ""
        log.info("engine %s is in (capacity %g)", member.name, member.capacity)
        self._changed()

    async def check_all(self) -> None:
        async with anyio.create_task_group() as tg:
            for member in self.members:
                tg.start_soon(self.check, member)

    async def connect(self, wait_s: float = 0.0) -> None:
        """Check every member; until one is in, again for up to ``wait_s`` (an engine still
        starting). Raises when none is; those out are checked again by ``watch``."""
        deadline = anyio.current_time() + wait_s
        delay = 0.5
        while True:
            await self.check_all()
            if self.up():
                return
            remaining = deadline - anyio.current_time()
            if remaining <= 0:
                raise self.none_in(why=True)
            log.warning("%s; retrying for %.0f more seconds", self.none_in(why=True), remaining)
            await anyio.sleep(min(delay, remaining))  # backoff between attempts
            delay = min(delay * 2, 5.0)

    async def watch(self) -> None:
        """Check every member every ``interval_s``, until cancelled (in the service's task group)."""
        while True:
            await anyio.sleep(self.interval_s)  # the health check's period, not synchronisation
            await self.check_all()

    def figures(self) -> list[dict[str, Any]]:
        return [member.figures() for member in self.members]

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            for member in self.members:
                if member.engine is not None:
                    await member.engine.aclose()
