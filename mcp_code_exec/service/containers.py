"""The container factory: every container and session volume this service makes, and where.

It owns the engine and the session volumes, starts containers from the one hardened spec (labelled
as this service's, so its end-of-service sweep finds each), keeps the two warm pools (stateless
containers, and the spares new sessions take), and over several engines does the placement glue:
warm containers move to an engine that came back, and a container lost with its engine is told
apart from one lost by what ran in it. It knows nothing of sessions: the keeper (``keeper``)
decides which container a session has. With egress, every sandbox mounts the proxy's socket volume
(``egress_volume``) read-only.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

import anyio
from anyio.abc import TaskGroup

from ..config.sections import PoolSettings, SandboxSettings
from ..runtime.base import LABEL_INSTANCE, LABEL_KIND, LABEL_OWNER, ContainerEngine, ContainerSpec
from ..runtime.cluster import ClusterEngine
from ..sandbox.container import Sandbox, start_sandbox
from ..sandbox.ownership import owner_token
from ..sandbox.pool import WarmPool
from ..sandbox.spec import Kind, container_spec
from ..sandbox.volumes import SessionVolumes


def service_labels(instance: str, kind: str) -> dict[str, str]:
    """The labels of what the service ``instance`` makes (its end-of-service sweep finds them)."""
    return {LABEL_OWNER: owner_token(), LABEL_INSTANCE: instance, LABEL_KIND: kind}


class ContainerFactory:
    def __init__(
        self,
        sandbox_settings: SandboxSettings,
        pool_settings: PoolSettings,
        engine: ContainerEngine,
        volumes: SessionVolumes,
        task_group: TaskGroup,
        instance: str,
        egress_volume: str | None = None,
    ) -> None:
        self.sandbox_settings, self.pool_settings = sandbox_settings, pool_settings
        self.engine = engine
        self.volumes = volumes
        self.instance = instance
        self.egress_volume = egress_volume
        self._tg = task_group
        # Over several engines: pools move containers to an engine that came back, and a stateless
        # run lost with its engine runs again elsewhere. With one engine, neither exists.
        self.cluster = engine if isinstance(engine, ClusterEngine) else None
        misplaced = None if self.cluster is None else self._misplaced
        self.stateless_pool = WarmPool(
            "stateless",
            lambda: self.start("stateless"),
            size=pool_settings.size,
            max_size=pool_settings.max_size,
            grow_after_s=pool_settings.grow_after_s,
            acquire_timeout_s=pool_settings.acquire_timeout_s,
            max_runs=1 if pool_settings.mode == "single-use" else pool_settings.max_runs_per_container,
            misplaced=misplaced,
        )
        self.session_spares = WarmPool(
            "sessions",
            lambda: self.start("session"),
            size=pool_settings.session_spares,
            acquire_timeout_s=pool_settings.start_timeout_s,
            start_after=self.stateless_pool.ready,  # the first call is most likely a stateless run
            misplaced=misplaced,
        )

    @asynccontextmanager
    async def warm(self) -> AsyncIterator[None]:
        """The pools kept filled (and, over several engines, the engines watched) until the block ends."""
        async with self.stateless_pool, self.session_spares:
            if self.cluster is not None:
                self.cluster.health.on_change.append(self._rebalance)
                self._tg.start_soon(self.cluster.health.watch)
            yield

    # -- making containers -----------------------------------------------------------------------
    def labels(self, kind: str) -> dict[str, str]:
        return service_labels(self.instance, kind)

    def spec(self, kind: Kind, volume: str | None = None) -> ContainerSpec:
        """The hardened spec of this service's containers (labelled as its own, so its end-of-service
        sweep covers any started from it: the benchmark's docker run baseline does). A session's
        container runs as the uid that owns its volume's files; any other gets a uid of its own."""
        uid, nocopy = self.volumes.uid_for(volume), self.volumes.nocopy(volume)
        labels, egress = self.labels(kind), self.egress_volume
        return container_spec(
            self.sandbox_settings, labels, volume, uid=uid, volume_nocopy=nocopy, egress_volume=egress
        )

    async def start(self, kind: Kind, volume: str | None = None) -> Sandbox:
        """A new container; a session's on ``volume``, or on a new volume when None."""
        created_volume = None
        try:
            if kind == "session" and volume is None:
                volume = created_volume = self.volumes.new_name()
                await self.volumes.create(volume, self.labels("session"))
            return await start_sandbox(
                self.engine, self.spec(kind, volume), self._tg, kind=kind, timeout_s=self.pool_settings.start_timeout_s
            )
        except BaseException:
            if created_volume is not None:
                with anyio.CancelScope(shield=True):
                    await self.volumes.remove(created_volume)
            raise

    async def new_session_container(self) -> Sandbox:
        """A container on a new volume, for a new session: a warm spare when there are any."""
        if self.pool_settings.session_spares > 0:
            return await self.session_spares.take()
        return await self.start("session")

    # -- session volumes ---------------------------------------------------------------------------
    async def copy_volume(self, source: str) -> str:
        """A new session volume holding what ``source`` holds, its files owned as they are there."""
        name = self.volumes.new_name()
        size = self.volumes.size if self.volumes.enforced else None
        await self.engine.copy_volume(source, name, self.labels("session"), size)
        self.volumes.adopt(name, self.volumes.uid_for(source))
        return name

    async def remove_volume(self, name: str) -> None:
        await self.volumes.remove(name)

    # -- several engines -----------------------------------------------------------------------------
    def _misplaced(self, sandbox: Sandbox) -> bool:
        return self.cluster is not None and self.cluster.should_move(sandbox.container_id)

    def _rebalance(self) -> None:
        """An engine came (back) in, or went out: warm containers over another engine's share move
        to one under its share (when one went out, nothing is: its containers are lost anyway)."""
        self.stateless_pool.retire_misplaced()
        self.session_spares.retire_misplaced()

    async def engine_lost(self, sandbox: Sandbox) -> str | None:
        """Over several engines, the name of a lost container's engine when that engine stopped
        answering; None when the container alone was lost (and always with one engine)."""
        if self.cluster is None:
            return None
        return await self.cluster.lost_with_engine(sandbox.container_id)
