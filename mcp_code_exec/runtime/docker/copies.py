"""Copying a volume on Docker (a session's fork): a short-lived helper container mounts both.

The helper runs the sandbox image's own ``cp`` (its system copy, by a fixed PATH) as root with
only the capabilities a faithful copy needs (owners, modes, times of files it may not read as
their owner), no network, a read-only root and the source mounted read-only. ``cp -a`` copies
symbolic links as links and never follows one, so a link the session planted to anywhere is a
link in the copy too, pointing where it pointed; it never reads a device (the sandbox cannot make
one, and the helper has no CAP_MKNOD to copy one). The target is made as ``create_volume`` makes
any volume, sized where asked, so the copy meets the same quota (ENOSPC) as the session would.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import anyio
import docker.errors
import docker.types

from ...config.units import MIB
from ...errors import EngineError, SandboxError
from ..base import LABEL_KIND, VolumeSize

if TYPE_CHECKING:
    from .engine import DockerEngine

log = logging.getLogger(__name__)
COPY_TIMEOUT_S = 600
SCRIPT = "export PATH=/usr/bin:/bin; cp -a --no-preserve=context /from/. /to/"
CAPABILITIES = ["CHOWN", "DAC_OVERRIDE", "DAC_READ_SEARCH", "FOWNER", "FSETID"]


async def copy_volume(
    engine: DockerEngine, source: str, target: str, labels: dict[str, str], size: VolumeSize | None = None
) -> None:
    await engine.create_volume(target, labels, size)
    try:
        code, err = await engine.call(
            _run_blocking, engine, source, target, {**labels, LABEL_KIND: "copy-helper"}, abandon=False
        )
        if code != 0:
            said = err.strip().splitlines()[-1][:300] if err.strip() else f"exit status {code}"
            raise EngineError(f"copying the volume {source} failed: {said}")
    except BaseException:
        with anyio.CancelScope(shield=True):
            try:
                await engine.remove_volume(target)
            except SandboxError as exc:
                log.warning("could not remove the volume %s whose copy failed: %s", target, exc)
        raise


def _run_blocking(engine: DockerEngine, source: str, target: str, labels: dict[str, str]) -> tuple[int, str]:
    """Create, start, wait for and remove the helper (blocking; in a worker thread)."""
    api = engine.client.api
    host_config = api.create_host_config(
        network_mode="none",
        cap_drop=["ALL"],
        cap_add=CAPABILITIES,
        security_opt=["no-new-privileges"],
        mounts=[
            docker.types.Mount(target="/from", source=source, type="volume", read_only=True, no_copy=True),
            docker.types.Mount(target="/to", source=target, type="volume", no_copy=True),
        ],
        read_only=True,
        pids_limit=64,
        mem_limit=256 * MIB,
        log_config=docker.types.LogConfig(type="json-file", config={"max-size": "1m"}),
    )
    created = api.create_container(
        engine.disks.image,
        entrypoint=["/bin/sh", "-c", SCRIPT],
        labels=labels,
        host_config=host_config,
        network_disabled=True,
        user="0:0",
    )
    container_id: str = created["Id"]
    try:
        api.start(container_id)
        status: dict[str, Any] = api.wait(container_id, timeout=COPY_TIMEOUT_S)
        err = api.logs(container_id, stdout=False, stderr=True).decode(errors="replace")
        return int(status.get("StatusCode", -1)), err
    finally:
        try:
            api.remove_container(container_id, force=True)
        except docker.errors.APIError as exc:  # a leftover carries our labels: a sweep removes it
            log.warning("could not remove the copy helper %s: %s", container_id[:12], exc)
