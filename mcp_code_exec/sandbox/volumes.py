"""Session volumes: made (of a fixed size, where the engine can), removed, and remembered until then.

The one place that knows who enforces a session's disk quota (``limits.session_disk``). With the
filesystem, each session volume is a filesystem of the quota's size (``VolumeSize``): writes past
it fail with ENOSPC, whatever hides the usage from a count (a deleted file kept alive by a memory
mapping, or by a descriptor in flight on a unix socket). The agent's count inside the sandbox runs
either way: it gives the early, friendly message; the filesystem is the limit that holds.
"""

from __future__ import annotations

import logging
from typing import Literal, NamedTuple

from ..config.sections import Limits
from ..errors import SandboxError, VolumeSizeUnsupported
from ..runtime.base import LABEL_KIND, LABEL_OWNER, ContainerEngine, VolumeSize
from .ownership import SandboxUids, new_volume_name, owner_token

log = logging.getLogger(__name__)


class Enforcement(NamedTuple):
    """Who enforces a session's disk quota, and why not the filesystem when "auto" fell back."""

    by: Literal["filesystem", "agent"]
    why_not: str | None


class SessionVolumes:
    def __init__(self, engine: ContainerEngine, limits: Limits) -> None:
        self.engine = engine
        self.setting = limits.session_disk
        self.size = VolumeSize(bytes=limits.session_data_bytes, entries=limits.session_max_files)
        # Volumes made and maybe not removed (a superset): an engine stopping or killed mid-create
        # keeps the directory but may lose the labels, so the end-of-service sweep looks these up
        # by name as well as by label.
        self.names: set[str] = set()
        self.uids: dict[str, int] = {}  # the sandbox uid that owns each volume's files
        self._uid_source = SandboxUids()
        self.enforced_by: Literal["filesystem", "agent"] = "agent"
        self.why_not: str | None = None  # why not the filesystem, when "auto" fell back

    async def resolve(self) -> None:
        """Decide, once, before any volume is made, who enforces the quota.

        Decided at start, not at the first failure: a volume that cannot be made later fails its
        session rather than quietly lose its size. Raises ``VolumeSizeUnsupported`` when the
        setting is "filesystem" and the engine cannot make sized volumes.
        """
        if self.setting == "agent":
            return
        try:
            reason = await self.engine.volume_size_support({LABEL_OWNER: owner_token(), LABEL_KIND: "disk-helper"})
        except SandboxError as exc:
            reason = str(exc)
        if reason is None:
            self.enforced_by = "filesystem"
            return
        if self.setting == "filesystem":
            raise VolumeSizeUnsupported(
                f"limits.session_disk is 'filesystem', but {reason}; run the engine on Linux as root with loop "
                "devices, or set limits.session_disk = 'agent' (or 'auto') to accept the agent's count alone"
            )
        self.why_not = reason
        log.warning(
            "session disk quotas are enforced only by the sandbox's own count (%s): hidden usage (a deleted file "
            "kept alive by a memory mapping) can fill the engine's disk; see limits.session_disk",
            reason,
        )

    def new_name(self) -> str:
        name = new_volume_name()
        self.names.add(name)  # before it exists: a cancelled creation is still swept
        return name

    @property
    def enforcement(self) -> Enforcement:
        return Enforcement(self.enforced_by, self.why_not)

    @property
    def enforced(self) -> bool:
        """Whether every session volume is a filesystem of the quota's size (decided by ``resolve``)."""
        return self.enforced_by == "filesystem"

    async def create(self, name: str, labels: dict[str, str]) -> None:
        if self.enforced:
            await self.engine.create_volume(name, labels, self.size)
        else:
            await self.engine.create_volume(name, labels)

    def uid_for(self, name: str | None) -> int:
        """The uid user code runs as in a container on this volume (the same for its life, so its
        files stay its own); a container without a volume gets a uid of its own."""
        if name is not None and name in self.uids:
            return self.uids[name]
        uid = self._uid_source.take(in_use=set(self.uids.values()))
        if name is not None:
            self.uids[name] = uid
        return uid

    def adopt(self, name: str, uid: int) -> None:
        """A volume whose files already belong to ``uid`` (a copy of another, a stopped server's):
        containers on it run as that uid."""
        self.uids[name] = uid

    def nocopy(self, name: str | None) -> bool:
        """Whether the volume's top is mounted as made (sized volumes are made root:1000 0775)."""
        return name is not None and self.enforced

    async def remove(self, name: str) -> None:
        """Remove a session volume; one the engine would not remove now is left to the end-of-service sweep."""
        try:
            await self.engine.remove_volume(name)
        except SandboxError as exc:
            log.warning("could not remove volume %s: %s", name, exc)
        else:
            self.names.discard(name)
            self.uids.pop(name, None)
