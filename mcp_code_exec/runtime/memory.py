"""An in-memory ``ContainerEngine``: its containers are coroutines, for tests without Docker.

Like httpx's ``MockTransport``: you give it the code that plays a container's agent, and the rest
of the package runs over it unchanged (channel, sandbox, pool, sessions, service)::

    async with MemoryEngine(agent) as engine:
        async with SandboxService.start(config, engine=engine) as service: ...

``agent(stream, spec)`` gets the container's side of its byte stream: it reads the host's frames
and writes the agent's (``stream.aclose()`` or returning ends the container). Containers and
volumes are kept in dicts with their labels, so sweeps and leak checks work as with an engine; a
sized volume's filesystem is an entry in ``disks`` that, as on Docker, is made after its volume
and removed after it (``fail_disk_removal`` plays a helper that fails between the two).
"""

from __future__ import annotations

import itertools
import math
from collections.abc import Awaitable, Callable
from types import TracebackType

import anyio
from anyio.abc import ByteStream, TaskGroup
from anyio.streams.memory import MemoryObjectReceiveStream, MemoryObjectSendStream

from ..errors import EngineError, EngineUnavailable, SandboxLost, VolumeSizeUnsupported
from .base import ContainerRecord, ContainerSpec, VolumeRecord, VolumeSize, without_missing_binds

Agent = Callable[[ByteStream, ContainerSpec], Awaitable[None]]


class MemoryByteStream(ByteStream):
    """One end of an in-memory byte pipe pair."""

    def __init__(self, send: MemoryObjectSendStream[bytes], receive: MemoryObjectReceiveStream[bytes]) -> None:
        self._send = send
        self._receive = receive

    async def receive(self, max_bytes: int = 65536) -> bytes:
        return await self._receive.receive()

    async def send(self, item: bytes) -> None:
        await self._send.send(bytes(item))

    async def send_eof(self) -> None:
        await self._send.aclose()

    async def aclose(self) -> None:
        await self._send.aclose()
        await self._receive.aclose()


def byte_pipe() -> tuple[MemoryByteStream, MemoryByteStream]:
    """Two connected ends: what one sends, the other receives."""
    a_send, b_receive = anyio.create_memory_object_stream[bytes](max_buffer_size=math.inf)
    b_send, a_receive = anyio.create_memory_object_stream[bytes](max_buffer_size=math.inf)
    return MemoryByteStream(a_send, a_receive), MemoryByteStream(b_send, b_receive)


class MemoryEngine:
    """``ContainerEngine`` in memory. ``images``: image name -> labels (default: any image, no labels).
    ``crash()`` and ``recover()`` play an engine killed and started again."""

    endpoint = "memory://"

    def __init__(self, agent: Agent, images: dict[str, dict[str, str]] | None = None, *, prefix: str = "mem") -> None:
        self.agent = agent
        self.prefix = prefix  # of its container ids: engines of one cluster need distinct ones
        self.images = images
        self.running: dict[str, tuple[ContainerSpec, anyio.CancelScope]] = {}
        self.volume_labels: dict[str, dict[str, str]] = {}
        self.copies: list[tuple[str, str]] = []  # (source, target) of each volume copied
        self.disks: dict[str, VolumeSize] = {}  # the filesystems of sized volumes, by volume name
        self.size_support: str | None = None  # a reason: play an engine that cannot size volumes
        self.fail_disk_removal: Exception | None = None
        self.cpu_s: dict[str, float] = {}  # what ``cpu_usage_s`` says of a container (tests set it)
        self.started = 0
        self.fail_starts: Exception | None = None  # set to make every start fail (backoff tests)
        self.answering = True  # False: every call fails as a dead engine's would (see ``crash``)
        self._ids = itertools.count(1)
        self._tg: TaskGroup | None = None

    async def __aenter__(self) -> MemoryEngine:
        self._tg = anyio.create_task_group()
        await self._tg.__aenter__()
        return self

    async def __aexit__(
        self, et: type[BaseException] | None, e: BaseException | None, tb: TracebackType | None
    ) -> bool | None:
        assert self._tg is not None
        self._tg.cancel_scope.cancel()
        return await self._tg.__aexit__(et, e, tb)

    def crash(self) -> None:
        """Play an engine killed: every container's stream closes, and nothing answers until
        ``recover``. Volumes are kept, as an engine keeps them on disk."""
        self.answering = False
        for _, scope in list(self.running.values()):
            scope.cancel()

    def recover(self) -> None:
        self.answering = True

    def _check(self) -> None:
        if not self.answering:
            raise EngineUnavailable("the memory engine is not answering")

    async def ping(self) -> None:
        self._check()

    async def image_labels(self, image: str) -> dict[str, str] | None:
        self._check()
        if self.images is None:
            return {}
        return self.images.get(image)

    async def start(self, spec: ContainerSpec) -> tuple[str, ByteStream]:
        if self._tg is None:
            raise EngineError("the memory engine is not running (use it as an async context manager)")
        self._check()
        if self.fail_starts is not None:
            raise self.fail_starts
        if spec.binds:
            spec = await anyio.to_thread.run_sync(without_missing_binds, spec)  # as the Docker adapter does
        container_id = f"{self.prefix}{next(self._ids):06d}"
        host_end, container_end = byte_pipe()
        scope = anyio.CancelScope()
        self.running[container_id] = (spec, scope)
        self.started += 1
        self._tg.start_soon(self._run, container_id, spec, container_end, scope)
        return container_id, host_end

    async def _run(
        self, container_id: str, spec: ContainerSpec, stream: MemoryByteStream, scope: anyio.CancelScope
    ) -> None:
        with scope:
            try:
                await self.agent(stream, spec)
            except* (anyio.EndOfStream, anyio.ClosedResourceError, anyio.BrokenResourceError, SandboxLost):
                pass  # the stream closed under it: the container exited
        with anyio.CancelScope(shield=True):
            await stream.aclose()
        self.running.pop(container_id, None)  # auto-remove, as the Docker adapter's containers

    async def remove(self, container_id: str) -> None:
        self._check()
        found = self.running.pop(container_id, None)
        if found is not None:
            found[1].cancel()

    async def containers(self, label: str) -> list[ContainerRecord]:
        self._check()
        key, _, value = label.partition("=")
        return [
            ContainerRecord(id=container_id, labels=dict(spec.labels), state="running")
            for container_id, (spec, _) in self.running.items()
            if key in spec.labels and (not value or spec.labels[key] == value)
        ]

    async def create_volume(self, name: str, labels: dict[str, str], size: VolumeSize | None = None) -> None:
        self._check()
        if size is not None and self.size_support is not None:
            raise VolumeSizeUnsupported(f"the engine cannot make a sized volume: {self.size_support}")
        self.volume_labels[name] = dict(labels)
        if size is not None:
            self.disks[name] = size

    async def copy_volume(
        self, source: str, target: str, labels: dict[str, str], size: VolumeSize | None = None
    ) -> None:
        self._check()
        if source not in self.volume_labels:
            raise EngineError(f"no volume {source} to copy")
        await self.create_volume(target, labels, size)
        self.copies.append((source, target))

    async def remove_volume(self, name: str) -> None:
        self._check()
        self.volume_labels.pop(name, None)
        if name in self.disks:
            if self.fail_disk_removal is not None:
                raise self.fail_disk_removal
            del self.disks[name]

    async def volume_size_support(self, labels: dict[str, str]) -> str | None:
        return self.size_support

    async def sweep_volume_disks(self, labels: dict[str, str]) -> int:
        orphans = [name for name in self.disks if name not in self.volume_labels]
        for name in orphans:
            del self.disks[name]
        return len(orphans)

    async def volumes(self, label: str) -> list[VolumeRecord]:
        self._check()
        key, _, value = label.partition("=")
        return [
            VolumeRecord(name=name, labels=labels)
            for name, labels in self.volume_labels.items()
            if key in labels and (not value or labels[key] == value)
        ]

    async def unused_volumes(self, name_prefix: str) -> list[VolumeRecord]:
        self._check()
        used = {spec.volume for spec, _ in self.running.values()}
        return [
            VolumeRecord(name=name, labels=labels)
            for name, labels in self.volume_labels.items()
            if name.startswith(name_prefix) and name not in used
        ]

    async def runtimes(self) -> list[str]:
        self._check()
        return ["memory"]

    async def cpu_usage_s(self, container_id: str) -> float | None:
        """What a test set in ``cpu_s`` for a running container (None: no figure)."""
        self._check()
        return self.cpu_s.get(container_id) if container_id in self.running else None

    async def architecture(self) -> str:
        self._check()
        return "x86_64"

    async def aclose(self) -> None:
        return None
