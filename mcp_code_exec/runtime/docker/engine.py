"""Docker adapter: ``ContainerEngine`` on the Docker SDK.

Every blocking SDK call runs in a worker thread (``DockerEngine.call``). Docker's and requests'
exceptions are turned into ours in ``translate``, and nowhere else. Beside it: where an engine is
looked for (``endpoints``), the attach stream as plain bytes (``attach``), the image operations
(``images``), sized volumes (``disks``), volume copies (``copies``), the egress proxy (``egress``).
Only this package imports the SDK.
"""

from __future__ import annotations

import functools
import logging
from collections.abc import Callable
from typing import Any, TypeVar

import anyio
import anyio.to_thread
import docker
import docker.errors
import requests.exceptions
from anyio.abc import ByteStream

from ...config.settings import DEFAULT_IMAGE
from ...errors import EngineError, EngineUnavailable, ImageMissing, SandboxError
from ..base import ContainerMemory, ContainerRecord, ContainerSpec, VolumeRecord, VolumeSize, without_missing_binds
from . import egress, stats
from .attach import Connect, DemuxedStream, socket_stream, tls_connector, upgraded_attach
from .copies import copy_volume
from .disks import VolumeDisks
from .endpoints import candidate_endpoints, make_client
from .mounts import MASKED_PATHS, container_mounts
from .ssh import SshTunnel

T = TypeVar("T")
log = logging.getLogger(__name__)
BUILD_HINT = "build it with `mcp-code-exec image build`"
START_HINT = (
    "start Docker Desktop, or the engine (`sudo systemctl start docker`, or `dockerd &` as root), "
    "or point DOCKER_HOST at a running engine"
)


def translate(exc: BaseException, *, image: str | None = None) -> SandboxError:
    """Map a Docker SDK / transport error to ours."""
    if isinstance(exc, SandboxError):
        return exc
    if isinstance(exc, docker.errors.ImageNotFound) or (
        isinstance(exc, docker.errors.NotFound) and image is not None and "image" in str(exc).lower()
    ):
        return ImageMissing(f"the sandbox image {image!r} is not present; {BUILD_HINT}")
    if isinstance(exc, requests.exceptions.ConnectionError | ConnectionError | FileNotFoundError):
        return EngineUnavailable(f"the Docker engine stopped answering ({_short(exc)}); {START_HINT}")
    if isinstance(exc, docker.errors.APIError):
        return EngineError(f"the Docker engine refused: {exc.explanation or exc}")
    if isinstance(exc, docker.errors.DockerException | requests.exceptions.RequestException):
        return EngineError(f"Docker error: {_short(exc)}")
    return EngineError(f"unexpected engine error: {type(exc).__name__}: {_short(exc)}")


def _short(exc: BaseException) -> str:
    """The exception in one line of at most 300 characters; its type name when it has no message."""
    lines = str(exc).strip().splitlines()
    text = lines[0] if lines else type(exc).__name__
    return text if len(text) < 300 else text[:300] + "..."


class DockerEngine:
    """``ContainerEngine`` on the Docker SDK."""

    def __init__(
        self,
        client: docker.DockerClient,
        endpoint: str,
        attach: Connect | None = None,
        tunnel: SshTunnel | None = None,
        *,
        disk_image: str = DEFAULT_IMAGE,
    ) -> None:
        """``attach``: where attach streams are connections of our own (a TLS engine's); ``tunnel``: the
        ssh forwarding an ssh:// engine's socket; ``disk_image``: the sized volumes' and copies' tools."""
        self.client = client
        self.endpoint = endpoint
        self._attach = attach
        self._tunnel = tunnel
        self.local = endpoint.startswith("unix://") and tunnel is None  # its containers' cgroups are here
        self.disks = VolumeDisks(self, disk_image)
        self._cpu_counters = stats.HostCpuCounters()

    @classmethod
    async def connect(
        cls,
        explicit: str | None = None,
        *,
        timeout_s: float = 10.0,
        cert_path: str | None = None,
        disk_image: str = DEFAULT_IMAGE,
    ) -> DockerEngine:
        """``cert_path``: a tcp:// engine's TLS client files (ca.pem, cert.pem, key.pem)."""
        tried: list[str] = []
        for url in candidate_endpoints(explicit):
            tunnel = SshTunnel(url) if url.startswith("ssh://") else None
            try:
                with anyio.fail_after(timeout_s):
                    if tunnel is not None:
                        await tunnel.ensure(timeout_s)
                    client = await anyio.to_thread.run_sync(
                        functools.partial(make_client, tunnel.url if tunnel else url, cert_path),
                        abandon_on_cancel=True,
                    )
                attach = None if cert_path is None else await anyio.to_thread.run_sync(tls_connector, url, cert_path)
                return cls(client, url, attach, tunnel, disk_image=disk_image)
            except (Exception, TimeoutError) as exc:  # noqa: BLE001 - every failure means "try the next"
                if tunnel is not None:
                    await tunnel.close()
                tried.append(f"{url} ({_short(exc)[:120]})")
        raise EngineUnavailable(f"no Docker engine answers (tried: {'; '.join(tried)}); {START_HINT}")

    @classmethod
    async def connect_waiting(
        cls, explicit: str | None, wait_s: float, *, disk_image: str = DEFAULT_IMAGE
    ) -> DockerEngine:
        """``connect``, retried with backoff for up to ``wait_s`` (an engine that is still starting)."""
        deadline = anyio.current_time() + wait_s
        delay = 0.5
        while True:
            try:
                return await cls.connect(explicit, disk_image=disk_image)
            except EngineUnavailable as exc:
                remaining = deadline - anyio.current_time()
                if remaining <= 0:
                    raise
                log.warning("%s; retrying for %.0f more seconds", exc, remaining)
                await anyio.sleep(min(delay, remaining))  # backoff between attempts
                delay = min(delay * 2, 5.0)

    async def call(
        self, fn: Callable[..., T], *args: Any, image: str | None = None, abandon: bool = True, **kwargs: Any
    ) -> T:
        """``fn`` in a worker thread, its errors translated (the one door to the blocking SDK)."""
        # abandon=False for calls that create something: a cancelled caller must learn what was
        # made, or the abandoned thread creates it after the caller's cleanup ran (a leak).
        # The client's own timeout still bounds such a call when the engine stops answering.
        try:
            return await anyio.to_thread.run_sync(functools.partial(fn, *args, **kwargs), abandon_on_cancel=abandon)
        except Exception as exc:
            raise translate(exc, image=image) from exc

    async def ping(self) -> None:
        if self._tunnel is not None:
            await self._tunnel.ensure()  # its ssh exited (the network went away): again
        await self.call(self.client.ping)

    async def image_labels(self, image: str) -> dict[str, str] | None:
        try:
            info = await anyio.to_thread.run_sync(self.client.api.inspect_image, image, abandon_on_cancel=True)
        except docker.errors.ImageNotFound:
            return None
        except Exception as exc:
            raise translate(exc, image=image) from exc
        return dict((info.get("Config") or {}).get("Labels") or {})

    async def start(self, spec: ContainerSpec) -> tuple[str, ByteStream]:
        container_id = await self.call(self._create, spec, image=spec.image, abandon=False)
        try:
            stream = DemuxedStream(await self._attach_to(container_id), container_id[:12])
            await self.call(self.client.api.start, container_id)
        except BaseException:
            with anyio.CancelScope(shield=True):
                await self.remove(container_id)
            raise
        return container_id, stream

    async def _attach_to(self, container_id: str) -> ByteStream:
        if self._attach is not None:
            try:
                return await upgraded_attach(self._attach, container_id)
            except Exception as exc:
                raise translate(exc) from exc
        raw = await self.call(
            self.client.api.attach_socket,
            container_id,
            params={"stdin": 1, "stdout": 1, "stderr": 1, "stream": 1},
            abandon=False,  # an abandoned attach would leak its socket
        )
        return await socket_stream(raw)

    def _create(self, spec: ContainerSpec) -> str:
        api = self.client.api
        spec = without_missing_binds(spec)
        mounts = container_mounts(spec)
        host_config = api.create_host_config(
            auto_remove=True,
            init=True,
            read_only=True,
            network_mode="bridge" if spec.network else "none",
            cap_drop=["ALL"],
            cap_add=["KILL", "SETUID", "SETGID"],
            security_opt=["no-new-privileges", *([f"seccomp={spec.seccomp_profile}"] if spec.seccomp_profile else [])],
            sysctls=dict(spec.sysctls) or None,
            mem_limit=spec.memory_bytes,
            memswap_limit=spec.memory_bytes,
            nano_cpus=spec.nano_cpus,
            pids_limit=spec.pids,
            ulimits=[
                docker.types.Ulimit(name="nofile", soft=spec.nofile, hard=spec.nofile),
                docker.types.Ulimit(name="fsize", soft=spec.fsize_bytes, hard=spec.fsize_bytes),
                docker.types.Ulimit(name="core", soft=0, hard=0),
            ],
            tmpfs=spec.tmpfs,
            shm_size=spec.shm_bytes,
            ipc_mode="private",
            log_config=docker.types.LogConfig(type="none"),
            mounts=mounts or None,
            runtime=spec.runtime,
        )
        host_config["MaskedPaths"] = MASKED_PATHS
        created = api.create_container(
            spec.image,
            command=spec.command,
            stdin_open=True,  # with detach=False this also sets StdinOnce.
            # The attached client is the container's lifeline: when the server goes away, stdin
            # closes, the agent exits and auto-remove deletes the container.
            environment=dict(spec.environment),
            labels=spec.labels,
            host_config=host_config,
            network_disabled=not spec.network,
            user="0:0",
            working_dir="/mnt/data",
        )
        container_id: str = created["Id"]
        return container_id

    async def remove(self, container_id: str) -> None:
        self._cpu_counters.forget(container_id)
        try:
            await anyio.to_thread.run_sync(
                functools.partial(self.client.api.remove_container, container_id, force=True),
                abandon_on_cancel=True,
            )
        except docker.errors.NotFound:
            return
        except docker.errors.APIError as exc:
            if exc.status_code == 404:
                return
            if exc.status_code != 409:
                raise translate(exc) from exc
            # Removal already under way (auto-remove after its stdin closed): wait until it is
            # done, or the caller's next step (removing the session's volume) finds it in use.
            await self._wait_removed(container_id)
        except Exception as exc:
            raise translate(exc) from exc

    async def _wait_removed(self, container_id: str, timeout_s: float = 30.0) -> None:
        try:
            await anyio.to_thread.run_sync(
                functools.partial(self.client.api.wait, container_id, timeout=timeout_s, condition="removed"),
                abandon_on_cancel=True,
            )
        except docker.errors.NotFound:
            return
        except (docker.errors.APIError, requests.exceptions.RequestException) as exc:
            log.debug("waiting for the removal of %s: %s", container_id[:12], exc)

    async def containers(self, label: str) -> list[ContainerRecord]:
        found = await self.call(self.client.api.containers, all=True, filters={"label": label})
        return [ContainerRecord(id=c["Id"], labels=c.get("Labels") or {}, state=c.get("State", "")) for c in found]

    async def create_volume(self, name: str, labels: dict[str, str], size: VolumeSize | None = None) -> None:
        if size is not None:
            await self.disks.create(name, labels, size)
        else:
            await self.call(self.client.api.create_volume, name=name, labels=labels, abandon=False)

    copy_volume, start_proxy, proxy_volume, runtime_args = copy_volume, *egress.PROXY_METHODS  # see their modules

    async def remove_volume(self, name: str) -> None:
        sized = await self.disks.sized_labels(name)
        await self._remove_volume_only(name)
        if sized is not None:
            await self.disks.remove([name], sized)  # after the volume, never before (see disks.py)

    async def volume_size_support(self, labels: dict[str, str]) -> str | None:
        return await self.disks.support(labels)

    async def sweep_volume_disks(self, labels: dict[str, str]) -> int:
        return await self.disks.sweep(labels)

    async def _remove_volume_only(self, name: str) -> None:
        for attempt in range(20):
            try:
                await anyio.to_thread.run_sync(
                    functools.partial(self.client.api.remove_volume, name, force=True), abandon_on_cancel=True
                )
                return
            except docker.errors.NotFound:
                return
            except docker.errors.APIError as exc:
                # "volume is in use": the container that used it is still being removed (a
                # container killed from outside, or auto-remove racing us). It lets go shortly.
                if exc.status_code != 409 or attempt == 19:
                    raise translate(exc) from exc
            except Exception as exc:
                raise translate(exc) from exc
            await anyio.sleep(0.1 * (attempt + 1))  # backoff while the engine finishes a removal

    async def volumes(self, label: str) -> list[VolumeRecord]:
        found = await self.call(self.client.api.volumes, filters={"label": label})
        return [VolumeRecord(name=v["Name"], labels=v.get("Labels") or {}) for v in (found.get("Volumes") or [])]

    async def unused_volumes(self, name_prefix: str) -> list[VolumeRecord]:
        found = await self.call(self.client.api.volumes, filters={"dangling": True, "name": name_prefix})
        volumes = [v for v in (found.get("Volumes") or []) if v["Name"].startswith(name_prefix)]
        return [VolumeRecord(name=v["Name"], labels=v.get("Labels") or {}) for v in volumes]

    async def runtimes(self) -> list[str]:
        return sorted(((await self.call(self.client.info)).get("Runtimes") or {}).keys())

    async def architecture(self) -> str:
        return str((await self.call(self.client.info)).get("Architecture") or "unknown")

    async def cpu_usage_s(self, container_id: str) -> float | None:
        # Its cgroup on this host where the engine is local: the stats wait for their collector's tick (~1 s).
        figure = await self._cpu_counters.figure(container_id) if self.local else None
        return figure if figure is not None else stats.cpu_s(await self._stats(container_id))

    async def memory_usage(self, container_id: str) -> ContainerMemory:
        """A running container's memory, in bytes. For the benchmark; no request path calls it."""
        return stats.memory(await self._stats(container_id))

    async def _stats(self, container_id: str) -> dict[str, Any]:
        return dict(await self.call(self.client.api.stats, container_id, stream=False, one_shot=True))

    async def exec_once(self, container_id: str, command: list[str], *, user: str = "1000:1000") -> tuple[int, bytes]:
        """``docker exec`` of one command (the benchmark's baseline): (exit code, stdout+stderr)."""

        def _exec() -> tuple[int, bytes]:
            api = self.client.api
            exec_id = api.exec_create(container_id, command, user=user, workdir="/mnt/data")["Id"]
            output = api.exec_start(exec_id)
            code = api.exec_inspect(exec_id).get("ExitCode")
            return (-1 if code is None else int(code)), bytes(output or b"")

        return await self.call(_exec)

    async def aclose(self) -> None:
        self._cpu_counters.close()
        await anyio.to_thread.run_sync(self.client.close)
        if self._tunnel is not None:
            await self._tunnel.close()
