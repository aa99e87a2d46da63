"""What a sandbox container is started with (limits, tmpfs mounts, environment), and what each run
in it is given (its caps and quotas), from the config."""

from __future__ import annotations

from typing import Literal

from ..config import mounts
from ..config.sections import HostMount, Limits, RunSettings, SandboxSettings, SessionSettings
from ..config.units import MIB
from ..egress.sandboxes import MOUNT as EGRESS_MOUNT
from ..egress.sandboxes import sandbox_environment as egress_environment
from ..protocol import messages as wire
from ..runtime.base import BindMount, ContainerSpec
from .ownership import SANDBOX_UIDS
from .seccomp import profile_json

SANDBOX_GID = 1000  # every sandbox user's group (the image's /mnt/data is group-writable for it)
# Under gVisor the container's pids limit counts gVisor's own threads (its Go runtime's, one more for
# each host call in flight), not the sandbox's processes (an rlimit counts those, see
# sandbox_environment). Egress keeps host sockets busy, and with it the sentry was measured at 124
# threads and killed at a limit of 128 (Go's "failed to create new OS thread"): it gets this much more.
RUNSC_EGRESS_THREADS = 256
# What a container is, and so what a run in it is: stateless (a warm pool's, its /mnt/data a tmpfs
# wiped between runs) or a session's (on the session's volume). The host's one spelling of the two;
# the wire carries it as ``Exec.mode``.
Kind = Literal["stateless", "session"]


def container_spec(
    sandbox: SandboxSettings,
    labels: dict[str, str],
    volume: str | None = None,
    *,
    uid: int = SANDBOX_UIDS[0],
    volume_nocopy: bool = False,
    egress_volume: str | None = None,
) -> ContainerSpec:
    """A warm container's spec: stateless without ``volume``, a session's with its volume
    (``volume_nocopy``: mounted with its top directory as it was made, see ``ContainerSpec``);
    user code runs as ``uid`` (see ``ownership.SandboxUids``). With ``egress_volume`` (the egress
    proxy's socket) the sandbox still has no network, but its agent's relay listens on its loopback
    for the proxy, so internet sockets are allowed (they reach that loopback only)."""
    if uid not in SANDBOX_UIDS:
        raise ValueError(f"sandbox uid {uid} is outside {SANDBOX_UIDS}")
    limits, runtime = sandbox.limits, sandbox.runtime
    tmp, data, shm = tmpfs_sizes(limits, "stateless" if volume is None else "session")
    tmpfs = {
        "/tmp": f"rw,nosuid,nodev,{tmpfs_size(tmp)},mode=1777",
        "/run/mcpx": "rw,nosuid,nodev,noexec,size=16m,mode=0700",
    }
    if volume is None:
        tmpfs["/mnt/data"] = f"rw,nosuid,nodev,{tmpfs_size(data)},uid={uid},gid={SANDBOX_GID},mode=0755"
    return ContainerSpec(
        image=sandbox.image,
        labels=labels,
        memory_bytes=limits.memory_bytes,
        nano_cpus=int(limits.cpus * 1e9),
        pids=limits.pids + (RUNSC_EGRESS_THREADS if egress_volume and runtime == "runsc" else 0),
        nofile=limits.nofile,
        fsize_bytes=limits.fsize_bytes,
        tmpfs=tmpfs,
        shm_bytes=shm,
        runtime=runtime,
        network=sandbox.network,
        volume=volume,
        volume_nocopy=volume_nocopy,
        binds=host_binds(sandbox.mounts),
        read_only_volumes=((egress_volume, EGRESS_MOUNT),) if egress_volume else (),
        environment={
            **sandbox_environment(limits, runtime),
            **(egress_environment() if egress_volume else {}),
            **lean_environment(sandbox, stateless=volume is None),
            "MCPX_SANDBOX_UID": str(uid),
        },
        seccomp_profile=profile_json(runtime, network=sandbox.network or egress_volume is not None),
        # A closed TCP connection would otherwise stay in TIME_WAIT with its ports for a minute,
        # visible to the next stateless run (/proc/net/tcp, or a bind that fails): a channel
        # between clients. The container has its own network namespace, so this is its own.
        sysctls={"net.ipv4.tcp_max_tw_buckets": "0"},
    )


def host_binds(host_mounts: tuple[HostMount, ...]) -> tuple[BindMount, ...]:
    """The configured host directories, for sessions and stateless containers alike.

    Stateless containers get them too: the bind costs nothing per run, and the post-run wipe never
    reaches /mnt/host (it empties only /tmp, /mnt/data, /dev/shm and /dev/mqueue, and never crosses
    into another filesystem). What a run writes to a writable mount stays there, by design.
    """
    return tuple(
        BindMount(source=str(mount.path), target=mounts.target(mount.name), read_only=not mount.writable)
        for mount in host_mounts
    )


def lean_environment(sandbox: SandboxSettings, *, stateless: bool) -> dict[str, str]:
    """The lean zygote, where it pays: in a stateless container (a session's cells may import
    anything later, and run in the full zygote's worker), and not under gVisor, whose copies of
    shared memory would cost most of a second heap."""
    lean = sandbox.lean_interpreter and stateless and sandbox.runtime != "runsc"
    return {"MCPX_LEAN_ZYGOTE": "1"} if lean else {}


def sandbox_environment(limits: Limits, runtime: str | None) -> dict[str, str]:
    # BLAS and OpenMP start a thread per host core, and OpenBLAS threads spin after each call:
    # under a CPU quota smaller than the core count they spend the quota the cell needs (a small
    # plot took twice as long). One thread per CPU of quota, fixed when the agent imports numpy.
    threads = str(max(1, int(limits.cpus)))
    environment = {name: threads for name in ("OPENBLAS_NUM_THREADS", "OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    if runtime == "runsc":
        # gVisor does not enforce the pids cgroup; its kernel counts only the sandbox's processes,
        # so a per-user process limit stands in there (under runc it would count the host's too).
        environment["MCPX_NPROC"] = str(limits.pids)
        # gVisor copies private memory in pieces far larger than a page: a supervisor forked after
        # the imports, sharing the libraries' heap, would end up with most of a copy of it.
        environment["MCPX_SPLIT_BEFORE_IMPORTS"] = "1"
    return environment


def tmpfs_sizes(limits: Limits, kind: Kind) -> tuple[int, int, int]:
    """Sizes of /tmp, /mnt/data (stateless) and /dev/shm in bytes (whole MiB), as the container gets them.

    tmpfs pages count against the container's memory limit, so tmpfs sizes that add up to more
    than the memory turn "disk full" into an OOM kill (a lost session, no ENOSPC). The configured
    sizes are scaled down, together, to fit in half the memory limit; the rest is for processes.
    """
    sizes = [limits.tmp_bytes, limits.data_bytes if kind == "stateless" else 0, limits.shm_bytes]
    budget = max(3 * MIB, limits.memory_bytes // 2 // MIB * MIB)
    total = sum(sizes)
    if total > budget:
        sizes = [max(MIB, size * budget // total // MIB * MIB) if size else 0 for size in sizes]
    return sizes[0], sizes[1], sizes[2]


def tmpfs_size(size: int) -> str:
    """A tmpfs's size options for ``size`` bytes (whole MiB): the size, and a file count (64 a MiB),
    so creating empty files ends in ENOSPC, not in an OOM kill."""
    return f"size={size // MIB}m,nr_inodes={max(1024, size // MIB * 64)}"


def run_options(limits: Limits, sessions: SessionSettings, run_settings: RunSettings, kind: Kind) -> wire.RunOptions:
    cap = limits.max_output_bytes
    caps = wire.RunOptions(
        max_output_bytes=cap,
        max_result_bytes=cap,
        max_display_bytes=cap,
        max_displays=limits.max_displays,
        max_images=limits.max_images,
        max_image_bytes=limits.max_image_bytes,
        max_image_pixels=limits.max_image_pixels,
    )
    if kind == "session":
        quota = {"data_quota_bytes": limits.session_data_bytes, "data_quota_files": limits.session_max_files}
        durable = {
            "snapshot_max_bytes": sessions.snapshot_max_bytes or None,  # 0: no snapshots
            "history_max_bytes": sessions.history_max_bytes or None,
        }
        return caps.model_copy(update={"keep_originals": True, **quota, **durable})
    kept = run_settings.files_max_file_bytes
    return caps.model_copy(update={"collect_bytes": kept * 4, "collect_file_bytes": kept})


def install(options: wire.RunOptions, packages: tuple[str, ...]) -> wire.RunOptions:
    """The run's options, with the packages its worker installs before the code (run_python's ``packages``)."""
    return options.model_copy(update={"install": list(packages)}) if packages else options
