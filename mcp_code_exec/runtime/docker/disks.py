"""Sized volumes on Docker: each one an ext4 image on a loop device, made through the engine.

Docker's local driver cannot cap a volume on an ext4 data root (no project quotas), and cannot
loop-mount an image file (``o=loop``: mount(2) sets up no loop device); it does mount a block
device. So a sized volume is an ext4 image in the store (the ``mcp-code-exec-disks`` volume, on the
engine's disk), preallocated so that it never takes more of the host disk than it was given and
never fails for want of it, attached to a loop device; the volume's ``device`` is a link to that
device. Hostile code meets ENOSPC at the image's size whatever holds the blocks (a name, an open
descriptor, a memory mapping, a descriptor in flight on a unix socket).

Everything is done by a short-lived helper container of the sandbox image (it has mke2fs, debugfs
and losetup: Debian's required packages), with CAP_SYS_ADMIN, the host's /dev and the loop
devices' cgroup rule, and no network: so it works for a remote engine, and for a server that is
not root. The rules that keep one session from mounting another's filesystem or leaking disk:

- the volume is created before its disk and removed before it: a disk whose volume is gone is
  debris, and a sweep that lists the disks before the volumes never takes one being made;
- a loop device is found by the image's inode (``losetup -j``), never by a remembered number:
  numbers are reused, and a volume naming ``/dev/loopN`` mounted another session's filesystem once
  its own had been detached;
- the links are on the engine host's /dev (devtmpfs, emptied at a reboot like the loop devices,
  where /run may be a plain directory): a volume whose disk is not attached fails to mount; one
  directory per engine, for engines that share a host;
- one lock in the store orders the helpers of an engine, so a detach never races an attach.
"""

from __future__ import annotations

import hashlib
import logging
import re
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import anyio
import docker.errors
import docker.types

from ...config.units import MIB
from ...errors import EngineError, SandboxError, VolumeSizeUnsupported
from ..base import LABEL_KIND, VolumeSize

if TYPE_CHECKING:
    from .engine import DockerEngine

log = logging.getLogger(__name__)
STORE = "mcp-code-exec-disks"
LINK_ROOT = "/dev/mcp-code-exec"
HELPER_TIMEOUT_S = 60
RESERVE_KIB = 1024 * 1024  # a new disk must leave this much of the engine's disk free
NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9_.-]{0,127}")  # a Docker volume name; nothing the shell reads

# No "discard" anywhere: a discard would punch holes in the preallocated image, which could then
# fail to grow back on a full host disk (the sparse images measured here lost data that way).
MKFS = (
    "mke2fs -t ext4 -q -F -m 0 -b 4096 -O ^resize_inode"
    " -E root_owner=0:1000,nodiscard,lazy_itable_init=0,lazy_journal_init=1"
)
# The system's tools only, by a fixed PATH: the image's /usr/local/bin (pip's console scripts)
# must not stand in for losetup or mke2fs in a container with these rights.
SCRIPT = r"""set -eu
export PATH=/usr/sbin:/usr/bin:/sbin:/bin
op=$1 links=$2
shift 2
exec 9>/store/.lock
flock -w 30 9 || { echo "another helper held the store's lock for 30 s" >&2; exit 5; }
for tool in losetup mke2fs debugfs fallocate; do
  command -v "$tool" >/dev/null || { echo "the helper image has no $tool" >&2; exit 3; }
done
if ! losetup -f >/dev/null 2>&1; then echo "no loop device can be set up here" >&2; exit 3; fi
mkdir -p "$links"
case "$op" in
create)
  name=$1 img=/store/$1.img
  if [ "$(df -Pk /store | awk 'NR == 2 {print $4}')" -lt $(($2 / 1024 + $5)) ]; then
    echo "no room for $2 bytes and $5 KiB to spare" >&2; exit 4
  fi
  if ! err=$(fallocate -l "$2" "$img" 2>&1); then
    rm -f "$img"
    case "$err" in *"No space"*) echo "no room for $2 bytes" >&2; exit 4 ;; esac
    echo "$err" >&2; exit 3
  fi
  if [ "$(df -Pk /store | awk 'NR == 2 {print $4}')" -lt "$5" ]; then
    rm -f "$img"; echo "no room for $2 bytes and $5 KiB to spare" >&2; exit 4
  fi
  @MKFS@ -N "$4" -J size="$3" "$img" || { rm -f "$img"; exit 1; }
  printf 'rmdir lost+found\nsif <2> mode 040775\n' | debugfs -w -f - "$img" >/dev/null 2>&1 || true
  if [ "$(debugfs -R 'ls -p /' "$img" 2>/dev/null | grep -c .)" != 2 ]; then
    rm -f "$img"; echo "lost+found could not be removed" >&2; exit 1
  fi
  dev=$(losetup -f --show "$img") || { rm -f "$img"; exit 3; }
  ln -sfn "$dev" "$links/$name"
  echo "$dev"
  ;;
remove)
  for name in "$@"; do
    img=/store/$name.img
    if [ -e "$img" ]; then
      for dev in $(losetup -n -O NAME -j "$img"); do losetup -d "$dev" || true; done
      if [ -n "$(losetup -n -O NAME -j "$img")" ]; then echo "$img is still attached" >&2; exit 1; fi
    fi
    rm -f "$links/$name" "$img"
  done
  ;;
list)
  for f in /store/*.img; do if [ -e "$f" ]; then basename "$f" .img; fi; done
  for f in "$links"/*; do if [ -L "$f" ]; then basename "$f"; fi; done
  ;;
esac
""".replace("@MKFS@", MKFS)


@dataclass(frozen=True)
class DiskPlan:
    image_bytes: int
    journal_mb: int
    inodes: int


def plan(size: VolumeSize) -> DiskPlan:
    """An image whose free space (as ``statvfs`` counts it for a user) is at least ``size.bytes``.

    Besides the files: the journal, the inode tables (256 bytes an inode; twice the entries the
    quota allows, so the filesystem is the backstop there too), what ext4 keeps back from every
    allocation (2% of the blocks, at most 16 MiB), and bitmaps, directories and extent blocks.
    """
    journal_mb = min(64, max(4, size.bytes // MIB // 64))
    inodes = max(2 * size.entries, 4096)
    image = size.bytes + journal_mb * MIB + inodes * 256 + 4 * MIB
    image += min(image // 50, 16 * MIB) + image // 200
    return DiskPlan(image_bytes=-(-image // MIB) * MIB, journal_mb=journal_mb, inodes=inodes)


def outcome(code: int, stderr: str, name: str) -> None:
    """The helper's exit status as ours (the one place its failures are mapped)."""
    said = stderr.strip().splitlines()[-1][:300] if stderr.strip() else f"exit status {code}"
    if code == 0:
        return
    if code == 3:
        raise VolumeSizeUnsupported(f"the engine cannot make a sized volume: {said}")
    if code == 4:
        raise EngineError(
            f"the engine's disk has no room for the volume {name} ({said}); free space, or lower "
            "limits.session_data_mb or the number of sessions"
        )
    raise EngineError(f"the helper that makes sized volumes failed for {name}: {said}")


class VolumeDisks:
    """The sized volumes of one ``DockerEngine`` (it delegates to this)."""

    def __init__(self, engine: DockerEngine, image: str) -> None:
        self.engine = engine
        self.image = image  # the helper runs the sandbox image: present, current, and it has the tools
        # Sized volumes made here whose disk is not removed yet (name: labels): a removal that
        # finds the volume gone still knows to remove its disk.
        self.pending: dict[str, dict[str, str]] = {}
        self._facts: tuple[str, str | None] | None = None  # (the engine's link directory, runtime)
        self._probed = False
        self._why_not: str | None = None  # once probed: None where sized volumes can be made

    async def support(self, labels: dict[str, str]) -> str | None:
        if not self._probed:
            await self._helper("probe", [], labels)
        return self._why_not

    async def create(self, name: str, labels: dict[str, str], size: VolumeSize) -> None:
        if not NAME.fullmatch(name):
            raise EngineError(f"not a volume name for a sized volume: {name!r}")
        disk = plan(size)
        links, _ = await self._engine_facts()
        options = {"type": "ext4", "device": f"{links}/{name}", "o": "nosuid,nodev"}
        api = self.engine.client.api
        await self.engine.call(
            api.create_volume, name=name, driver="local", driver_opts=options, labels=labels, abandon=False
        )
        self.pending[name] = dict(labels)
        try:
            args = [name, str(disk.image_bytes), str(disk.journal_mb), str(disk.inodes), str(RESERVE_KIB)]
            await self._helper("create", args, labels, name=name)
        except BaseException as exc:
            if isinstance(exc, VolumeSizeUnsupported):
                self.pending.pop(name, None)  # the helper did not run, or undid what it had done
            with anyio.CancelScope(shield=True):
                try:
                    await self.engine.remove_volume(name)
                except SandboxError as cleanup:
                    log.warning("could not remove the volume %s that failed to get its disk: %s", name, cleanup)
            raise
        log.debug("volume %s: an ext4 filesystem of %d MiB", name, disk.image_bytes // MIB)

    async def sized_labels(self, name: str) -> dict[str, str] | None:
        """The labels of a sized volume (to remove its disk with), or None for a plain one."""
        if name in self.pending:
            return self.pending[name]
        try:
            info = await self.engine.call(self.engine.client.api.inspect_volume, name)
        except SandboxError:
            return None  # gone, or the engine is: the removal that follows says which
        device = str((info.get("Options") or {}).get("device") or "")
        return dict(info.get("Labels") or {}) if device.startswith(LINK_ROOT + "/") else None

    async def remove(self, names: list[str], labels: dict[str, str]) -> None:
        """Detach and delete the disks of volumes that are gone (the volumes are removed first)."""
        await self._helper("remove", [name for name in names if NAME.fullmatch(name)], labels)
        for name in names:
            self.pending.pop(name, None)

    async def sweep(self, labels: dict[str, str]) -> int:
        """Remove the disks whose volume is gone; returns how many."""
        api = self.engine.client.api
        try:
            await self.engine.call(api.inspect_volume, STORE)
        except SandboxError:
            return 0  # no store: no sized volume was ever made on this engine (or it is down: later)
        listed = await self._helper("list", [], labels)  # the disks before the volumes: see the docstring
        if listed is None:
            return 0
        found = await self.engine.call(api.volumes)
        volumes = {volume["Name"] for volume in (found.get("Volumes") or [])}
        orphans = sorted({name for name in listed.split() if NAME.fullmatch(name)} - volumes)
        if orphans:
            await self.remove(orphans, labels)
            log.info("removed the disks of %d volumes that are gone: %s", len(orphans), ", ".join(orphans))
        return len(orphans)

    async def _engine_facts(self) -> tuple[str, str | None]:
        if self._facts is None:
            info = await self.engine.call(self.engine.client.info)
            engine_id = hashlib.sha256(str(info.get("ID") or self.engine.endpoint).encode()).hexdigest()[:16]
            # runc even where the engine's default is another runtime: gVisor has no loop devices.
            runtime = "runc" if "runc" in (info.get("Runtimes") or {}) else None
            self._facts = (f"{LINK_ROOT}/{engine_id}", runtime)
        return self._facts

    async def _helper(self, op: str, args: list[str], labels: dict[str, str], *, name: str = "") -> str | None:
        """Run the helper; its stdout, or None when probing found sized volumes unsupported."""
        links, runtime = await self._engine_facts()
        try:
            code, out, err = await self.engine.call(
                self._run_blocking,
                [op, links, *args],
                {**labels, LABEL_KIND: "disk-helper"},
                runtime,
                image=self.image,
                abandon=False,  # it creates a container, and removes it itself
            )
            outcome(code, err, name or op)
        except VolumeSizeUnsupported as exc:
            if op in ("probe", "list"):
                self._probed, self._why_not = True, str(exc)
                log.debug("sized volumes unsupported: %s", exc)
                return None
            raise
        if op in ("probe", "list"):
            self._probed, self._why_not = True, None
        return out

    def _run_blocking(self, command: list[str], labels: dict[str, str], runtime: str | None) -> tuple[int, str, str]:
        """Create, start, wait for and remove one helper container (blocking; in a worker thread)."""
        api = self.engine.client.api
        host_config = api.create_host_config(
            network_mode="none",
            cap_drop=["ALL"],
            cap_add=["SYS_ADMIN"],
            security_opt=["no-new-privileges"],
            devices=["/dev/loop-control:/dev/loop-control:rwm"],
            device_cgroup_rules=["b 7:* rwm"],
            binds=["/dev:/dev:rw"],
            mounts=[docker.types.Mount(target="/store", source=STORE, type="volume", labels={LABEL_KIND: "disks"})],
            read_only=True,
            pids_limit=64,
            mem_limit=256 * MIB,
            runtime=runtime,
            log_config=docker.types.LogConfig(type="json-file", config={"max-size": "1m"}),
        )
        try:
            created = api.create_container(
                self.image,
                entrypoint=["/bin/sh", "-c", SCRIPT, "mcpx-disk"],  # none of the image's own
                command=list(command),
                labels=labels,
                host_config=host_config,
                network_disabled=True,
                user="0:0",
            )
        except docker.errors.ImageNotFound:
            raise
        except docker.errors.APIError as exc:
            raise VolumeSizeUnsupported(f"the engine refused the helper container: {exc.explanation or exc}") from exc
        container_id: str = created["Id"]
        try:
            try:
                api.start(container_id)
            except docker.errors.APIError as exc:
                raise VolumeSizeUnsupported(f"the helper container did not start: {exc.explanation or exc}") from exc
            status: dict[str, Any] = api.wait(container_id, timeout=HELPER_TIMEOUT_S)
            out = api.logs(container_id, stdout=True, stderr=False).decode(errors="replace")
            err = api.logs(container_id, stdout=False, stderr=True).decode(errors="replace")
            return int(status.get("StatusCode", -1)), out, err
        finally:
            try:
                api.remove_container(container_id, force=True)
            except docker.errors.APIError as exc:  # a leftover carries our labels: a sweep removes it
                log.warning("could not remove the helper container %s: %s", container_id[:12], exc)
