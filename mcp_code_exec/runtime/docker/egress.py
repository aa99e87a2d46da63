"""The egress proxy's container on Docker (see ``base.ProxySpec``), and what the engine says of a
runtime's arguments (gVisor reaches the proxy's socket only with ``--host-uds=open``)."""

from __future__ import annotations

from typing import TYPE_CHECKING

import docker.errors
import docker.types
from anyio.abc import ByteStream

from ...errors import EngineError
from ..base import ProxySpec
from .attach import DemuxedStream

if TYPE_CHECKING:
    from .engine import DockerEngine

SOCKET_DIR = "/sock"
SOCKET_VOLUME_MB = 4  # the socket and the CA bundle sandboxes read


async def proxy_volume(engine: DockerEngine, spec: ProxySpec) -> None:
    await engine.call(_socket_volume, engine, spec, abandon=False)


async def start_proxy(engine: DockerEngine, spec: ProxySpec) -> tuple[str, ByteStream]:
    await proxy_volume(engine, spec)
    container_id = await engine.call(_create, engine, spec, image=spec.image, abandon=False)
    try:
        stream = DemuxedStream(await engine._attach_to(container_id), "egress-" + container_id[:12])
        await engine.call(engine.client.api.start, container_id)
    except BaseException:
        import anyio

        with anyio.CancelScope(shield=True):
            await engine.remove(container_id)
        raise
    return container_id, stream


def _socket_volume(engine: DockerEngine, spec: ProxySpec) -> None:
    """A tmpfs volume owned by the proxy's uid: whoever mounts it first (a sandbox may), the proxy
    can make its socket there; nothing of it is ever on disk, and it empties when nobody mounts it."""
    api = engine.client.api
    try:
        api.inspect_volume(spec.socket_volume)
        return
    except docker.errors.NotFound:
        pass
    options = f"size={SOCKET_VOLUME_MB}m,uid={spec.uid},gid={spec.uid},mode=0755,nosuid,nodev,noexec"
    api.create_volume(
        name=spec.socket_volume,
        driver="local",
        driver_opts={"type": "tmpfs", "device": "tmpfs", "o": options},
        labels=spec.labels,
    )


def _create(engine: DockerEngine, spec: ProxySpec) -> str:
    api = engine.client.api
    host_config = api.create_host_config(
        auto_remove=True,
        init=True,
        read_only=True,
        network_mode="bridge",
        cap_drop=["ALL"],
        security_opt=["no-new-privileges"],
        mem_limit=spec.memory_bytes,
        memswap_limit=spec.memory_bytes,
        pids_limit=spec.pids,
        ulimits=[
            docker.types.Ulimit(name="nofile", soft=spec.nofile, hard=spec.nofile),
            docker.types.Ulimit(name="core", soft=0, hard=0),
        ],
        tmpfs={
            "/run/egress": f"rw,nosuid,nodev,noexec,size=16m,uid={spec.uid},gid={spec.uid},mode=0700",
            "/tmp": "rw,nosuid,nodev,noexec,size=16m,mode=1777",
        },
        ipc_mode="private",
        log_config=docker.types.LogConfig(type="none"),
        mounts=[docker.types.Mount(target=SOCKET_DIR, source=spec.socket_volume, type="volume")],
        extra_hosts={name: address for name, address in spec.extra_hosts} or None,
        group_add=None if spec.socket_gid is None else [str(spec.socket_gid)],
    )
    created = api.create_container(
        spec.image,
        stdin_open=True,  # the attached server is its lifeline: when stdin closes, the proxy exits
        labels=spec.labels,
        host_config=host_config,
        user=f"{spec.uid}:{spec.uid}",
    )
    container_id: str = created["Id"]
    return container_id


def _args_of(found: object, runtime: str) -> list[str] | None:
    if found is None:
        return None
    if not isinstance(found, dict):
        raise EngineError(f"the engine describes the runtime {runtime!r} in a form this server does not know")
    return [str(arg) for arg in found.get("runtimeArgs") or []]


async def runtime_args(engine: DockerEngine, runtime: str) -> list[str] | None:
    info = await engine.call(engine.client.info)
    return _args_of((info.get("Runtimes") or {}).get(runtime), runtime)


PROXY_METHODS = (start_proxy, proxy_volume, runtime_args)  # ``base.ProxyEngine``, as DockerEngine's methods
