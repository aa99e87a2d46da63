"""The container-engine port: what the service needs from an engine, nothing more.

An adapter (``runtime.docker``; ``runtime.memory`` for tests) implements ``ContainerEngine``
and translates its library's errors into ours; nothing outside ``runtime/`` knows which engine
runs the containers or how it frames their streams.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field, replace
from typing import NamedTuple, Protocol, runtime_checkable

from anyio.abc import ByteStream

log = logging.getLogger(__name__)
LABEL_PREFIX = "org.mcp-code-exec"
LABEL_OWNER = f"{LABEL_PREFIX}.owner"
LABEL_KIND = f"{LABEL_PREFIX}.kind"
LABEL_INSTANCE = f"{LABEL_PREFIX}.instance"  # one running service (a process may run several)
LABEL_CONTEXT = f"{LABEL_PREFIX}.context-hash"
# A durable session's record (a volume holding nothing but these labels, see sandbox/records.py).
LABEL_SESSION = f"{LABEL_PREFIX}.session"  # the session id
LABEL_IDENTITY = f"{LABEL_PREFIX}.identity"  # a hash of the owner identity, never the identity itself
LABEL_REALM = f"{LABEL_PREFIX}.realm"  # a hash of its realm (an OAuth issuer and claim), if it has one
LABEL_CREATED = f"{LABEL_PREFIX}.created"  # when the session was made (epoch seconds)
LABEL_LIFETIME = f"{LABEL_PREFIX}.lifetime-s"  # how long it may live from then
LABEL_VOLUME = f"{LABEL_PREFIX}.volume"  # the session's data volume
LABEL_UID = f"{LABEL_PREFIX}.uid"  # the sandbox uid that owns the volume's files
LABEL_SCOPE = f"{LABEL_PREFIX}.scope"  # which servers may serve it again (``sessions.scope``)
LABEL_EGRESS = f"{LABEL_PREFIX}.egress"  # what it narrowed its egress to (JSON), when it did


@dataclass(frozen=True)
class BindMount:
    """A host directory in the container: ``source`` is resolved and was checked by the config."""

    source: str
    target: str
    read_only: bool = True


@dataclass(frozen=True)
class ContainerSpec:
    image: str
    labels: dict[str, str]
    memory_bytes: int
    nano_cpus: int
    pids: int
    nofile: int
    fsize_bytes: int
    tmpfs: dict[str, str]
    shm_bytes: int
    runtime: str | None = None
    network: bool = False
    volume: str | None = None  # a named volume mounted at /mnt/data (sessions)
    # Mount the volume's top directory as it was made (a sized volume is made root:1000 0775), rather
    # than have the engine copy the image's /mnt/data owner and mode onto it while it is empty.
    volume_nocopy: bool = False
    binds: tuple[BindMount, ...] = ()  # host directories the user configured (/mnt/host/<name>)
    read_only_volumes: tuple[tuple[str, str], ...] = ()  # (volume, target): the egress proxy's socket
    # -P: the agent starts in /mnt/data, which -m would put first on sys.path; a session's files there
    # must never be imported by the zygote (root) in place of a library (the workers put it back).
    command: list[str] = field(default_factory=lambda: ["python3", "-u", "-P", "-m", "mcpx_agent"])
    environment: dict[str, str] = field(default_factory=dict)  # for the agent; never the server's own
    seccomp_profile: str | None = None  # JSON; None: the engine's default profile
    sysctls: dict[str, str] = field(default_factory=dict)  # namespaced ones only (the container's network)


@dataclass(frozen=True)
class ProxySpec:
    """The egress proxy's container (see ``egress``): isolated like a sandbox (read-only root, no
    capabilities, no host directory, no engine socket, a uid of its own), but on the engine's
    default network, with ``socket_volume`` (a small tmpfs of its uid, made by the adapter) at
    /sock for the sandboxes to mount read-only, and ``extra_hosts`` as its /etc/hosts entries."""

    image: str
    labels: dict[str, str]
    socket_volume: str
    memory_bytes: int
    uid: int = 2000
    pids: int = 512
    nofile: int = 8192
    extra_hosts: tuple[tuple[str, str], ...] = ()  # (name, address)
    socket_gid: int | None = None  # a group of the proxy's too: its socket's, the only one that may connect


@runtime_checkable
class ProxyEngine(Protocol):
    """An engine that can also run the egress proxy (the Docker adapter; not the in-memory one)."""

    async def start_proxy(self, spec: ProxySpec) -> tuple[str, ByteStream]:
        """Make the socket volume if it is missing, then create, attach and start the proxy; its id
        and a byte stream to its stdin and stdout (as ``ContainerEngine.start``)."""
        ...

    async def proxy_volume(self, spec: ProxySpec) -> None:
        """Make the socket volume if it is missing (before any sandbox mounts it)."""
        ...

    async def runtime_args(self, runtime: str) -> list[str] | None:
        """The arguments the engine starts ``runtime`` with; None when it has no such runtime."""
        ...


class ContainerMemory(NamedTuple):
    usage: int  # the cgroup's usage: page cache included
    docker_stats: int  # less the inactive page cache, as ``docker stats`` shows it
    own: int  # less all file page cache: anonymous memory, tmpfs and kernel memory


def without_missing_binds(spec: ContainerSpec) -> ContainerSpec:
    """The spec less the host directories that are gone since the config was loaded (blocking).

    Every container of the pool carries the binds: one whose source vanished (a drive unplugged)
    would make every start fail, so the engines leave it out and say so; code then finds no
    /mnt/host/<name>, and ``doctor`` names the missing directory.
    """
    present = tuple(bind for bind in spec.binds if os.path.isdir(bind.source))
    for bind in spec.binds:
        if bind not in present:
            log.warning("host directory %s is gone: not mounted at %s", bind.source, bind.target)
    return spec if len(present) == len(spec.binds) else replace(spec, binds=present)


@dataclass(frozen=True)
class ContainerRecord:
    id: str
    labels: dict[str, str]
    state: str


@dataclass(frozen=True)
class VolumeSize:
    """A volume that is a filesystem of its own: room for at least ``bytes`` of files and ``entries``
    files and directories. The filesystem refuses writes past its size (ENOSPC), whatever holds the
    blocks: names, open descriptors, memory mappings, descriptors in flight on a socket."""

    bytes: int
    entries: int


@dataclass(frozen=True)
class VolumeRecord:
    name: str
    labels: dict[str, str]


class ContainerEngine(Protocol):
    """An engine that can run hardened containers and attach to their stdin/stdout."""

    endpoint: str

    async def ping(self) -> None: ...

    async def image_labels(self, image: str) -> dict[str, str] | None:
        """The image's labels, or None when the image is not present."""
        ...

    async def start(self, spec: ContainerSpec) -> tuple[str, ByteStream]:
        """Create, attach and start a container; returns its id and a byte stream to its agent.

        Reading the stream gives the container's stdout, as plain bytes; writing it feeds the
        container's stdin. How the engine carries them (Docker multiplexes stdout and stderr with
        8-byte headers) stays inside the adapter; the agent's stderr is only ever diagnostics.
        """
        ...

    async def remove(self, container_id: str) -> None:
        """Kill and remove; a container already gone is not an error."""
        ...

    async def containers(self, label: str) -> list[ContainerRecord]: ...

    async def create_volume(self, name: str, labels: dict[str, str], size: VolumeSize | None = None) -> None:
        """A named volume; with ``size``, a filesystem of that size of its own (see ``VolumeSize``).

        Raises ``VolumeSizeUnsupported`` when the engine cannot make one; nothing is left then.
        """
        ...

    async def copy_volume(
        self, source: str, target: str, labels: dict[str, str], size: VolumeSize | None = None
    ) -> None:
        """Make ``target`` (as ``create_volume`` does) holding a copy of every file of ``source``:
        owners, modes and times kept, symbolic links copied as links (never followed), hard links
        kept. The copy is made on the engine that holds ``source``; a failed copy leaves no
        ``target``. Raises ``EngineError`` when ``target`` cannot hold the files."""
        ...

    async def remove_volume(self, name: str) -> None:
        """Remove the volume, then its filesystem if it has one. A volume already gone is not an
        error; the filesystem of a sized volume this engine made is still removed then."""
        ...

    async def volume_size_support(self, labels: dict[str, str]) -> str | None:
        """None when ``create_volume`` can make sized volumes here; otherwise why not. ``labels`` go
        on whatever finding out starts."""
        ...

    async def sweep_volume_disks(self, labels: dict[str, str]) -> int:
        """Remove the filesystems of sized volumes that no longer exist (debris of a server that died
        while removing one); returns how many. ``labels`` go on whatever the sweep starts."""
        ...

    async def volumes(self, label: str) -> list[VolumeRecord]: ...

    async def unused_volumes(self, name_prefix: str) -> list[VolumeRecord]:
        """Volumes whose name starts with ``name_prefix`` that no container uses."""
        ...

    async def runtimes(self) -> list[str]:
        """Names of the container runtimes the engine can use (e.g. runc, runsc)."""
        ...

    async def cpu_usage_s(self, container_id: str) -> float | None:
        """The CPU seconds a running container used since it started, as its cgroup on the engine's
        host counts them (every process in it, whatever became of them; under gVisor the sandbox's own
        kernel too): nothing in the container can change the figure. None when it is not running."""
        ...

    async def architecture(self) -> str:
        """The machine architecture containers run on (``x86_64``, ``aarch64``)."""
        ...

    async def aclose(self) -> None: ...
