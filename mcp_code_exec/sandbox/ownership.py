"""Who owns a container, and removing what a dead server left behind (containers, volumes, and the
filesystems of sized volumes whose volume is gone)."""

from __future__ import annotations

import logging
import os
import re
import secrets
import socket
from collections.abc import Collection
from functools import cache

from ..errors import SandboxError
from ..runtime.base import LABEL_INSTANCE, LABEL_KIND, LABEL_OWNER, ContainerEngine

log = logging.getLogger(__name__)
VOLUME_PREFIX = "mcp-code-exec-"
VOLUME_NAME = re.compile(re.escape(VOLUME_PREFIX) + "[0-9a-f]{16}")
RECORD_KIND = "session-record"  # a durable session's record (see ``records``)
LEDGER_KIND = "quota-ledger"  # an identity's quota counts (see ``ledgers``)
DURABLE_KINDS = (RECORD_KIND, LEDGER_KIND)  # volumes that outlive their server on purpose


def new_volume_name() -> str:
    return VOLUME_PREFIX + secrets.token_hex(8)


# Far above the accounts of a host (Debian's useradd stops at 59999, subordinate ids for rootless
# containers start at 100000), so no sandbox can be steered onto a host user's files in a mount.
# Even ones only: the uid after each is its container's zygote's (see the agent's zygote.py).
SANDBOX_UIDS = range(1 << 30, (1 << 30) + (1 << 24), 2)


class SandboxUids:
    """A uid of its own for each sandbox's user code.

    The kernel keeps some counts per uid across the whole host, whatever the container: file
    descriptors in flight over unix sockets, pipe buffer pages, epoll watches. Were every sandbox
    the same uid, one tenant could use up a count and make another's calls fail. Drawn at random
    from 8.4 million, never one a live session of this service holds: no client can predict or
    steer its uid, and two containers share one (and so their counts, as every sandbox did before)
    with a chance of about one in 1700 for a hundred containers at once.
    """

    def take(self, in_use: Collection[int] = ()) -> int:
        while True:
            uid = SANDBOX_UIDS[secrets.randbelow(len(SANDBOX_UIDS))]
            if uid not in in_use:
                return uid


def _start_ticks(pid: int) -> str | None:
    """The process's start time in ticks; None when there is no such process, or it is a zombie (it
    has ended, and only waits to be reaped: a server killed a moment ago is gone already)."""
    try:
        with open(f"/proc/{pid}/stat") as handle:
            # The command name may hold spaces or parens; fields after the last ')' are fixed.
            fields = handle.read().rsplit(")", 1)[1].split()
    except OSError:
        return None
    if len(fields) < 20 or fields[0] in ("Z", "X"):
        return None
    return fields[19]


@cache
def owner_token() -> str:
    """host:pid:start-time of this process; survives pid reuse by another process."""
    return f"{socket.gethostname()}:{os.getpid()}:{_start_ticks(os.getpid()) or 0}"


def owner_alive(token: str) -> bool:
    """False only when we can tell the owner is gone (same host, and no such process now)."""
    try:
        host, pid_text, ticks = token.rsplit(":", 2)
        pid = int(pid_text)
    except ValueError:
        return False
    if host != socket.gethostname():
        return True  # another machine's server sharing this engine: not ours to judge
    current = _start_ticks(pid)
    return current is not None and (ticks == "0" or current == ticks)


async def sweep(engine: ContainerEngine, keep: Collection[str] = ()) -> tuple[int, int]:
    """Remove containers and volumes whose owning server is gone. Returns (containers, volumes).

    ``keep``: volumes to leave whoever made them (durable sessions' data volumes); the records of
    durable sessions and the quota ledgers are never swept here (see ``records`` and ``ledgers``: a
    start adopts or removes them)."""
    removed_containers = removed_volumes = 0
    mine = owner_token()
    for record in await engine.containers(LABEL_OWNER):
        owner = record.labels.get(LABEL_OWNER, "")
        if owner != mine and not owner_alive(owner):
            try:
                await engine.remove(record.id)
                removed_containers += 1
            except SandboxError as exc:
                log.warning("sweep: could not remove container %s: %s", record.id[:12], exc)
    for volume in await engine.volumes(LABEL_OWNER):
        owner = volume.labels.get(LABEL_OWNER, "")
        if volume.name in keep or volume.labels.get(LABEL_KIND) in DURABLE_KINDS:
            continue
        if owner != mine and not owner_alive(owner):
            try:
                await engine.remove_volume(volume.name)
                removed_volumes += 1
            except SandboxError as exc:
                log.warning("sweep: could not remove volume %s: %s", volume.name, exc)
    removed_volumes += await _sweep_unlabelled_volumes(engine)
    await _sweep_disks(engine)
    if removed_containers or removed_volumes:
        log.info(
            "removed %d containers and %d volumes left by a server that is gone", removed_containers, removed_volumes
        )
    return removed_containers, removed_volumes


async def _sweep_disks(engine: ContainerEngine) -> int:
    """The filesystems of sized volumes whose volume is gone: a server that died between removing
    a volume and its filesystem (the volume goes first), or whose volumes were swept by a server
    that does not know of filesystems. After the volume sweep, so this one finds its debris too."""
    try:
        return await engine.sweep_volume_disks({LABEL_OWNER: owner_token(), LABEL_KIND: "disk-helper"})
    except SandboxError as exc:
        log.warning("sweep: could not remove the filesystems of volumes that are gone: %s", exc)
        return 0


async def _sweep_unlabelled_volumes(engine: ContainerEngine) -> int:
    """Session volumes the engine holds without their labels, and no container uses.

    Every volume of ours is created with its labels in one call, and every mount of one carries
    them, so an unlabelled one is the debris of an engine killed while it was creating the volume
    (it finds the directory again when it restarts, and knows nothing else of it).
    """
    removed = 0
    for volume in await engine.unused_volumes(VOLUME_PREFIX):
        if volume.labels or not VOLUME_NAME.fullmatch(volume.name):
            continue
        try:
            await engine.remove_volume(volume.name)
            removed += 1
        except SandboxError as exc:
            log.warning("sweep: could not remove volume %s: %s", volume.name, exc)
    return removed


async def sweep_instance(
    engine: ContainerEngine,
    instance: str,
    volume_names: Collection[str] = (),
    timeout_s: float = 90.0,
    keep: Collection[str] = (),
) -> None:
    """The last step of a service's shutdown: remove anything of its own that is still there.

    Normally nothing is: every container and volume was removed as it was retired. This catches
    what a failed removal left (an engine that was restarting, a volume still in use by a
    container the engine was removing), which no later sweep would touch while we live.
    ``volume_names`` are the volumes the service created and did not see removed: one the engine
    was creating when it stopped or died keeps its directory but not always its labels, and a
    sized one whose volume went but whose filesystem did not is removed by name (the engine
    remembers which it made), as no volume lists it any more.
    """
    import anyio

    label = f"{LABEL_INSTANCE}={instance}"
    try:
        with anyio.fail_after(timeout_s):
            for record in await engine.containers(label):
                await engine.remove(record.id)
            labelled = {volume.name for volume in await engine.volumes(label)}
            for name in sorted((labelled | set(volume_names)) - set(keep)):
                await engine.remove_volume(name)  # also one already gone: its filesystem may not be
                log.debug("removed volume %s, if it was left by a failed removal or creation", name)
    except (SandboxError, TimeoutError) as exc:
        log.warning("could not remove everything this server started (%s); the next start will", exc)
