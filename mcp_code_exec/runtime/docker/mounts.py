"""What the Docker adapter mounts into a sandbox: the session's volume and the host directories."""

from __future__ import annotations

import docker.types

from ..base import ContainerSpec

# Docker's own list (moby's oci/defaults.go), which a list of ours replaces, and the block devices:
# under runc /sys/block and /proc/diskstats name every session volume's loop device on the host and
# count its writes, for anyone to watch.
MASKED_PATHS = [
    "/proc/asound",
    "/proc/acpi",
    "/proc/kcore",
    "/proc/keys",
    "/proc/latency_stats",
    "/proc/timer_list",
    "/proc/timer_stats",
    "/proc/sched_debug",
    "/proc/scsi",
    "/sys/firmware",
    "/sys/devices/virtual/powercap",
    "/sys/block",
    "/sys/class/block",
    "/sys/dev/block",
    "/sys/devices/virtual/block",
    "/proc/diskstats",
    "/proc/partitions",
]


def container_mounts(spec: ContainerSpec) -> list[docker.types.Mount]:
    """The session's volume at /mnt/data, read-only volumes (the egress proxy's socket) and the
    configured host directories."""
    mounts: list[docker.types.Mount] = []
    if spec.volume is not None:
        # Labels here too: should the volume be gone (removed while this start was under way), the
        # engine re-creates it from the mount, and with them a sweep still knows whose it is.
        mounts.append(
            docker.types.Mount(
                target="/mnt/data",
                source=spec.volume,
                type="volume",
                labels=spec.labels,
                no_copy=spec.volume_nocopy,
            )
        )
    for name, target in spec.read_only_volumes:  # made by their owner (the egress proxy's): never copied into
        mounts.append(docker.types.Mount(target=target, source=name, type="volume", read_only=True, no_copy=True))
    for bind in spec.binds:
        mount = docker.types.Mount(target=bind.target, source=bind.source, type="bind", read_only=bind.read_only)
        # Not recursive: a filesystem mounted inside the directory stays out. Engines before
        # Docker 25 make only the top of a recursive bind read-only, so what is mounted below it
        # would be writable. The target is created by the runtime, under the read-only root too.
        mount["BindOptions"] = {"NonRecursive": True}
        mounts.append(mount)
    return mounts
