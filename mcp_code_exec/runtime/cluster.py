"""Several engines as one: ``ContainerEngine`` over member engines, with placement and health.

The service runs over a ``ClusterEngine`` as over one engine; placement stays here:

- a container with a volume (a session's) starts on the engine that holds the volume, so a session
  stays put; while that engine is out the start raises ``EngineDown`` at once;
- a volume (a new session, or a spare waiting to become one) goes to the engine with the fewest
  sessions for its capacity: new sessions go where there is room;
- any other container goes to the engine with the fewest of its kind for its capacity, so each
  engine gets its share of the stateless pool; a start that an engine refuses (or that finds it
  stopped answering, which takes it out) is tried on the next engine, and the caller never hears of
  it unless every engine refuses.

Container ids and volume names are the members' own (what ``docker ps`` shows there); the cluster
remembers where each one lives. Health is ``members.py``'s ``MemberHealth``, which the cluster holds
as ``health``: a member that fails a check, or a call, with "not answering" is out: nothing new
goes there and its containers count as lost. When it answers again it is admitted again and
``on_change`` hooks run, so pools refill there.
"""

from __future__ import annotations

import logging
from collections.abc import Awaitable, Callable, Sequence
from typing import TypeVar

from anyio.abc import ByteStream

from ..errors import EngineDown, EngineError, SandboxError
from .base import LABEL_KIND, ContainerEngine, ContainerRecord, ContainerSpec, VolumeRecord, VolumeSize
from .members import OUT, SESSION, Admit, Member, MemberHealth

T = TypeVar("T")
log = logging.getLogger(__name__)


class ClusterEngine:
    """``ContainerEngine`` over several members (see the module's docstring): placement and calls
    here; which members are in, their checks and admission, in ``health``."""

    def __init__(
        self,
        members: Sequence[Member],
        *,
        admit: Admit | None = None,
        interval_s: float = 2.0,
        timeout_s: float = 5.0,
        admit_timeout_s: float = 120.0,
    ) -> None:
        self.health = MemberHealth(
            members, admit=admit, interval_s=interval_s, timeout_s=timeout_s, admit_timeout_s=admit_timeout_s
        )
        self.members = self.health.members
        self.endpoint = "cluster:" + ",".join(member.name for member in self.members)
        self._homes: dict[str, Member] = {}  # container id -> where it lives (ours, and any listed)
        self._volume_homes: dict[str, Member] = {}

    # -- placement -------------------------------------------------------------------------------
    def _place(self, kind: str, tried: set[Member]) -> Member:
        candidates = [member for member in self.health.up() if member not in tried]
        if not candidates:
            raise self.health.none_in()
        order = {member: index for index, member in enumerate(self.members)}
        return min(candidates, key=lambda m: (m.share(kind), m.load(), order[m]))

    def should_move(self, container_id: str) -> bool:
        """Whether a container would be better placed elsewhere (an engine came back, or joined):
        True marks it as leaving, so that the next question already counts it gone. A pool asks
        when a container comes back or waits idle; the one it starts instead goes to ``_place``."""
        member = self._homes.get(container_id)
        if member is None or not member.up or container_id not in member.containers:
            return False
        kind = member.containers[container_id]
        mine = member.share(kind)
        for other in self.health.up():
            if other is not member and mine > (other.count(kind) + 1) / other.capacity:
                member.moving.add(container_id)
                return True
        return False

    # -- calls on one member -----------------------------------------------------------------------
    async def _on(self, member: Member, call: Callable[[ContainerEngine], Awaitable[T]]) -> T:
        """``call`` on a member that is in; one that stopped answering is out (``EngineDown``)."""
        if not member.up or member.engine is None:
            raise EngineDown(member.name)
        try:
            return await call(member.engine)
        except OUT as exc:
            if not isinstance(exc, EngineDown):
                self.health.out(member, exc)
            raise EngineDown(member.name) from exc

    def _record(self, member: Member, container_id: str, kind: str) -> None:
        self._homes[container_id] = member
        if member.up:
            member.containers[container_id] = kind

    async def start(self, spec: ContainerSpec) -> tuple[str, ByteStream]:
        kind = spec.labels.get(LABEL_KIND, "other")
        if spec.volume is not None:
            home = self._volume_homes.get(spec.volume)
            if home is None:  # not made through us: it is made where the container starts
                home = self._place(SESSION, set())
                self._volume_homes[spec.volume] = home
            container_id, stream = await self._on(home, lambda engine: engine.start(spec))
            self._record(home, container_id, kind)
            return container_id, stream
        tried: set[Member] = set()
        refused: EngineError | None = None
        while True:
            try:
                member = self._place(kind, tried)
            except EngineError:
                if refused is None:
                    raise
                raise refused from None  # every engine that is in refused it: say why
            member.starting[kind] += 1
            try:
                container_id, stream = await self._on(member, lambda engine: engine.start(spec))
            except EngineDown:
                tried.add(member)  # out now: the next engine takes it
                continue
            except EngineError as exc:
                log.warning("engine %s refused a container (%s); trying another", member.name, exc)
                tried.add(member)  # it answers but cannot start this one: any other may
                refused = refused or exc
                continue
            finally:
                member.starting[kind] -= 1
            self._record(member, container_id, kind)
            return container_id, stream

    async def remove(self, container_id: str) -> None:
        member = self._homes.get(container_id)
        if member is None:
            for each in self.health.up():  # one we never saw: wherever it is (not found is no error)
                await self._on(each, lambda engine: engine.remove(container_id))
            return
        await self._on(member, lambda engine: engine.remove(container_id))
        self._homes.pop(container_id, None)
        member.containers.pop(container_id, None)
        member.moving.discard(container_id)

    async def create_volume(self, name: str, labels: dict[str, str], size: VolumeSize | None = None) -> None:
        tried: set[Member] = set()
        while True:
            member = self._place(SESSION, tried)
            member.starting[SESSION] += 1
            try:
                await self._on(member, lambda engine: engine.create_volume(name, labels, size))
            except EngineDown:
                tried.add(member)
                continue
            finally:
                member.starting[SESSION] -= 1
            member.volumes.add(name)
            self._volume_homes[name] = member
            return

    async def copy_volume(
        self, source: str, target: str, labels: dict[str, str], size: VolumeSize | None = None
    ) -> None:
        """On the engine that holds ``source`` (a copy cannot cross engines), whatever its load."""
        member = self._volume_homes.get(source)
        if member is None:
            raise EngineError(f"no engine is known to hold the volume {source}")
        await self._on(member, lambda engine: engine.copy_volume(source, target, labels, size))
        member.volumes.add(target)
        self._volume_homes[target] = member

    async def remove_volume(self, name: str) -> None:
        member = self._volume_homes.get(name)
        if member is None:
            for each in self.health.up():
                await self._on(each, lambda engine: engine.remove_volume(name))
            return
        await self._on(member, lambda engine: engine.remove_volume(name))
        self._volume_homes.pop(name, None)
        member.volumes.discard(name)

    async def volume_size_support(self, labels: dict[str, str]) -> str | None:
        """None when every engine that is in can make sized volumes; otherwise the first reason."""
        for member in self.health.up():
            reason = await self._on(member, lambda engine: engine.volume_size_support(labels))
            if reason is not None:
                return f"engine {member.name}: {reason}"
        return None

    async def sweep_volume_disks(self, labels: dict[str, str]) -> int:
        removed = 0
        for member in self.health.up():
            try:
                removed += await self._on(member, lambda engine: engine.sweep_volume_disks(labels))
            except SandboxError as exc:
                log.warning("engine %s: sweeping volume disks failed (%s)", member.name, exc)
        return removed

    # -- listings: every member that is in (one that fails is out, and left out) ------------------
    async def _gather(self, call: Callable[[ContainerEngine], Awaitable[list[T]]]) -> list[tuple[Member, T]]:
        found: list[tuple[Member, T]] = []
        for member in self.health.up():
            try:
                found += [(member, item) for item in await self._on(member, call)]
            except SandboxError as exc:
                log.warning("engine %s: listing failed (%s)", member.name, exc)
        return found

    async def containers(self, label: str) -> list[ContainerRecord]:
        found = await self._gather(lambda engine: engine.containers(label))
        for member, record in found:
            self._homes.setdefault(record.id, member)
        return [record for _, record in found]

    async def volumes(self, label: str) -> list[VolumeRecord]:
        return self._learn(await self._gather(lambda engine: engine.volumes(label)))

    async def unused_volumes(self, name_prefix: str) -> list[VolumeRecord]:
        return self._learn(await self._gather(lambda engine: engine.unused_volumes(name_prefix)))

    def _learn(self, found: list[tuple[Member, VolumeRecord]]) -> list[VolumeRecord]:
        for member, volume in found:
            self._volume_homes.setdefault(volume.name, member)
        return [volume for _, volume in found]

    # -- the engine as a whole -----------------------------------------------------------------------
    async def ping(self) -> None:
        """Answers when one member does."""
        for member in self.health.up():
            try:
                await self._on(member, lambda engine: engine.ping())
                return
            except SandboxError:
                continue
        raise self.health.none_in()

    async def image_labels(self, image: str) -> dict[str, str] | None:
        """The image's labels where it is; None when a member that is in lacks it."""
        labels: dict[str, str] | None = None
        for member in self.health.up():
            found = await self._on(member, lambda engine: engine.image_labels(image))
            if found is None:
                return None
            labels = found if labels is None else labels
        return labels

    async def runtimes(self) -> list[str]:
        """The runtimes every member that is in can use."""
        common: set[str] | None = None
        for member in self.health.up():
            names = set(await self._on(member, lambda engine: engine.runtimes()))
            common = names if common is None else common & names
        return sorted(common or ())

    async def cpu_usage_s(self, container_id: str) -> float | None:
        member = self._homes.get(container_id)
        return None if member is None else await self._on(member, lambda engine: engine.cpu_usage_s(container_id))

    async def architecture(self) -> str:
        if self.health.machine is None:
            raise self.health.none_in()
        return self.health.machine

    # -- what the service and /healthz ask ------------------------------------------------------------
    def volume_home(self, name: str) -> str | None:
        member = self._volume_homes.get(name)
        return None if member is None else member.name

    def home_of(self, container_id: str) -> str | None:
        """The name of the engine a container of ours lives on (None: not one we know)."""
        member = self._homes.get(container_id)
        return None if member is None else member.name

    def member_engine(self, container_id: str) -> ContainerEngine | None:
        member = self._homes.get(container_id)
        return None if member is None else member.engine

    async def lost_with_engine(self, container_id: str) -> str | None:
        """The name of a lost container's engine if it was lost with it (the engine is out, or does
        not answer now); None when the engine answers: the container alone was lost."""
        member = self._homes.get(container_id)
        if member is None or (member.up and await self.health.check(member, admit=False)):
            return None
        return member.name

    async def aclose(self) -> None:
        await self.health.aclose()
