"""A Debian base image made without a registry: debootstrap from the machine's own apt mirror.

debootstrap runs for a minute or more, as root, and mounts ``proc`` and ``sys`` (and, where it
cannot make device nodes, binds the host's ``/dev``) inside the tree it makes. So a stop must
end it and its children, and removing what it left must never pass through a mount: that would
remove the host's own files. It runs in a process group of its own, ended as a whole, and its
work directory is removed only once nothing is mounted under it.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Callable, Sequence
from pathlib import Path

import anyio
import anyio.abc
import anyio.to_thread

from ..errors import EngineError
from ..runtime.processes import stop_group
from ..sandbox.image import BUILD_COMMAND

STOP_GRACE_S = 10.0  # for debootstrap's own exit trap, which unmounts what it mounted


def debian_mirror(sources: Path = Path("/etc/apt"), suite: str = "bookworm") -> str | None:
    """The Debian mirror this machine's apt uses (never a host written into the repository)."""
    candidates = [*sorted(sources.glob("sources.list.d/*.sources")), sources / "sources.list"]
    candidates += sorted(sources.glob("sources.list.d/*.list"))
    for path in candidates:
        try:
            text = path.read_text()
        except OSError:
            continue
        for match in re.finditer(r"^URIs:\s*(\S+)", text, re.M):
            if "security" not in match.group(1) and "debian" in match.group(1):
                return match.group(1)
        for match in re.finditer(rf"^deb\s+(?:\[[^\]]*\]\s+)?(\S+)\s+{suite}\s", text, re.M):
            if "security" not in match.group(1):
                return match.group(1)
    return None


def _install_debootstrap(log: Callable[[str], None]) -> None:
    if shutil.which("debootstrap") is not None:
        return
    log("installing debootstrap (apt-get)")
    install = ["apt-get", "install", "-y", "-qq", "debootstrap"]
    subprocess.run(install, check=False, stdout=sys.stderr, stderr=sys.stderr)
    if shutil.which("debootstrap") is None:
        raise EngineError("no base image can be pulled and debootstrap is not installed; `apt-get install debootstrap`")


async def make_offline_rootfs(log: Callable[[str], None], suite: str = "bookworm", default_base: str = "") -> str:
    """debootstrap a minimal Debian ``suite`` into a tarball; returns its path, in a directory of
    its own that the caller removes. Needs root. Cancelled, it leaves nothing behind."""
    if os.geteuid() != 0:
        hint = f" (e.g. {default_base})" if default_base else ""
        raise EngineError(
            f"no base image can be pulled and making one offline needs root: run `sudo {BUILD_COMMAND}`, "
            f"or pass --base with an image you have{hint}"
        )
    # Not cancelled half-way: apt-get stopped mid-install can leave dpkg to be mended by hand.
    await anyio.to_thread.run_sync(_install_debootstrap, log)
    mirror = debian_mirror(suite=suite)
    if mirror is None:
        raise EngineError("no Debian mirror found in /etc/apt; pass --base with an image you have")
    work = tempfile.mkdtemp(prefix="mcp-code-exec-rootfs-")
    try:
        rootfs = os.path.join(work, "rootfs")
        log(f"debootstrap {suite} from {mirror} (about a minute)")
        code, errors = await run_in_own_group(["debootstrap", "--variant=minbase", suite, rootfs, mirror])
        if code != 0:
            raise EngineError(f"debootstrap failed: {errors.strip()[-500:]}")
        tarball = os.path.join(work, "rootfs.tar")
        code, errors = await run_in_own_group(["tar", "-C", rootfs, "-cf", tarball, "."])
        if code != 0:
            raise EngineError(f"the offline base could not be packed: {errors.strip()[-500:]}")
        await anyio.to_thread.run_sync(remove_without_crossing_mounts, rootfs, log)
        return tarball
    except BaseException:
        with anyio.CancelScope(shield=True):
            await anyio.to_thread.run_sync(remove_without_crossing_mounts, work, log)
        raise


async def run_in_own_group(command: Sequence[str], grace_s: float = STOP_GRACE_S) -> tuple[int, str]:
    """Run ``command`` in a new session; its exit code and the tail of its stderr. Cancelled, the
    whole group gets SIGTERM, then SIGKILL if its leader has not exited within ``grace_s``."""
    quiet = subprocess.DEVNULL
    async with await anyio.open_process(
        list(command), stdin=quiet, stdout=quiet, stderr=subprocess.PIPE, start_new_session=True
    ) as process:
        try:
            tail = bytearray()
            assert process.stderr is not None
            async for chunk in process.stderr:
                tail += chunk
                del tail[:-4096]
            return await process.wait(), tail.decode(errors="replace")
        except BaseException:
            with anyio.CancelScope(shield=True):
                await stop_group(process, grace_s=grace_s)  # SIGTERM first: debootstrap's exit trap unmounts
            raise


def mounts_under(path: str, table: str = "/proc/self/mountinfo") -> list[str]:
    """The mount points at or below ``path`` in this process's mount namespace."""
    root = os.path.realpath(path)
    points = []
    with open(table, encoding="utf-8", errors="surrogateescape") as lines:
        for line in lines:
            fields = line.split()
            # The mount point is the fifth field; the kernel writes space, tab, newline and backslash octal.
            point = re.sub(r"\\([0-7]{3})", lambda match: chr(int(match.group(1), 8)), fields[4])
            if point == root or point.startswith(root.rstrip("/") + "/"):
                points.append(point)
    return points


def unmount_under(path: str) -> list[str]:
    """Unmount what is mounted at or below ``path``, deepest first; what is still mounted there."""
    for point in sorted(mounts_under(path), key=len, reverse=True):
        subprocess.run(["umount", "--lazy", point], capture_output=True, check=False)
    return mounts_under(path)


def remove_without_crossing_mounts(path: str, log: Callable[[str], None]) -> None:
    """Remove ``path`` once nothing is mounted under it (unmounting what is); else leave it, and say so."""
    still = unmount_under(path)
    if still:
        log(f"left {path} in place: {still[0]} is still mounted there (unmount it, then remove the directory)")
        return
    shutil.rmtree(path, ignore_errors=True)
