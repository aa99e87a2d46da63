"""A session's /mnt/data is a filesystem of its own, the size of the quota (``limits.session_disk``).

Hostile code can hide usage from any count made inside the sandbox: a deleted file kept alive only
by a memory mapping, or by a descriptor in flight on a unix socket that nobody receives. With the
filesystem as the limit, that usage still meets ENOSPC at about the quota, under runc and gVisor,
and the host's disk holds no more than the volume's image. What a session had leaves nothing
behind: no volume, loop device, link or image file.
"""

from __future__ import annotations

import glob
import json
import subprocess
from collections.abc import AsyncIterator, Iterable
from pathlib import Path

import anyio
import pytest
from _security import runsc_available
from _support import make_test_config, project_volumes

from mcp_code_exec.runtime.base import LABEL_KIND, VolumeSize
from mcp_code_exec.runtime.docker.disks import LINK_ROOT, STORE, plan
from mcp_code_exec.runtime.docker.engine import DockerEngine
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
OWNER = "disk"
MIB = 1024 * 1024
QUOTA_MB = 64
RUNTIMES = ["runc", pytest.param("runsc", marks=pytest.mark.skipif(not runsc_available(), reason="no gVisor"))]
made: set[str] = set()  # every session volume the tests saw, checked for leftovers at the end


def host(*args: str) -> str:
    return subprocess.run(args, capture_output=True, text=True, timeout=60, check=False).stdout


def image_path(volume: str) -> Path:
    store = json.loads(host("docker", "volume", "inspect", STORE) or "[{}]")[0].get("Mountpoint", "/nonexistent")
    return Path(store, f"{volume}.img")


def leftovers(names: Iterable[str]) -> list[str]:
    """What the engine's host still holds of these volumes (the tests run beside the engine)."""
    volumes, loops = set(host("docker", "volume", "ls", "-q").split()), host("losetup", "-a")
    found = []
    for name in names:
        found += [f"volume {name}"] if name in volumes else []
        found += [f"loop device of {name}"] if f"{name}.img" in loops else []
        found += [f"link {link}" for link in glob.glob(f"{LINK_ROOT}/*/{name}")]
        found += [f"image {image_path(name)}"] if image_path(name).exists() else []
    return found


@pytest.fixture(scope="module", params=RUNTIMES)
async def sized(request: pytest.FixtureRequest) -> AsyncIterator[SandboxService]:
    limits = {"session_data_mb": QUOTA_MB, "session_max_files": 200, "session_disk": "filesystem"}
    config = make_test_config(
        runtime=None if request.param == "runc" else "runsc", limits=limits, pool={"size": 1, "session_spares": 1}
    )
    async with SandboxService.start(config) as service:
        yield service
        made.update(service.volumes.names)  # the spare's, made after the last session took one
    assert project_volumes(instance=service.instance) == []
    assert leftovers(made) == []


async def new_session(service: SandboxService) -> tuple[str, str]:
    sid = (await service.new_session(OWNER)).session_id
    volume = service.sessions.get(sid, OWNER).volume
    assert volume is not None
    made.add(volume)
    return sid, volume


STATVFS = "import os\nst = os.statvfs('/mnt/data')\nst.f_bavail * st.f_frsize"


async def test_a_session_volume_is_a_filesystem_of_its_own_a_little_larger_than_the_quota(
    sized: SandboxService,
) -> None:
    sid, volume = await new_session(sized)
    top = "import os\nst = os.stat('/mnt/data')\n(st.st_uid, st.st_gid, oct(st.st_mode & 0o7777), sorted(set(os.listdir('/mnt/data')) - {'.mcpx'}))"
    try:
        free = await sized.run(OWNER, STATVFS, session_id=sid)
        assert QUOTA_MB * MIB <= int(free.result or 0) <= QUOTA_MB * MIB * 1.01 + 8 * MIB, free
        # root:1000 0775, as the image's /mnt/data: the sandbox user writes, cannot chmod it; no lost+found
        assert (await sized.run(OWNER, top, session_id=sid)).result == "(0, 1000, '0o775', [])"
        if sized.config.runtime is None:  # gVisor shows its own view of the mount (9p)
            mounts = await sized.run(OWNER, "[l for l in open('/proc/mounts') if ' /mnt/data ' in l]", session_id=sid)
            assert f"{volume} /mnt/data ext4 rw,nosuid,nodev" in (mounts.result or ""), mounts
    finally:
        await sized.close_session(OWNER, sid)
    assert leftovers([volume]) == []


# Each writes files of 8 MiB, hides each one (its name gone, its blocks kept) until the disk is full.
HIDE = {
    # Through libc: Python's mmap object keeps a duplicate descriptor, which the agent's count sees.
    "memory-mappings": "held.append(libc.mmap(None, size, 1, 1, fd, 0))  # PROT_READ, MAP_SHARED",
    "descriptors-in-flight": "sender.sendmsg([b'x'], [(socket.SOL_SOCKET, socket.SCM_RIGHTS, array.array('i', [fd]))])",
}
HIDER = """
import array, ctypes, errno, os, socket
libc = ctypes.CDLL(None, use_errno=True)
libc.mmap.restype = ctypes.c_void_p
libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]
held, hidden, failure = [], 0, None
sender, receiver = socket.socketpair()  # nothing ever receives
chunk = os.urandom(1 << 20)
for i in range(40):
    fd = os.open(f'hide{{i}}', os.O_CREAT | os.O_RDWR, 0o600)
    try:
        for _ in range(8):
            os.write(fd, chunk)
        os.fsync(fd)
    except OSError as exc:
        failure = errno.errorcode[exc.errno]
    size = os.fstat(fd).st_size
    if size:
        {hide}
    os.close(fd)
    os.unlink(f'hide{{i}}')
    hidden += size
    if failure:
        break
(failure, hidden, sorted(set(os.listdir('/mnt/data')) - {{'.mcpx'}}))
"""


@pytest.mark.parametrize("hide", list(HIDE.values()), ids=list(HIDE))
async def test_usage_hidden_from_every_count_still_ends_at_the_quota(sized: SandboxService, hide: str) -> None:
    sid, volume = await new_session(sized)
    try:
        free = int((await sized.run(OWNER, STATVFS, session_id=sid)).result or 0)
        result = await sized.run(OWNER, HIDER.format(hide=hide), session_id=sid, timeout=60)
        assert result.status == "ok" and result.result is not None, result  # no count saw it
        failure, hidden, names = result.result.strip("()").split(", ", 2)
        assert (failure, names) == ("'ENOSPC'", "[]"), result
        assert free - 16 * MIB <= int(hidden) <= free  # it filled the filesystem, and no more
        more = await sized.run(OWNER, "open('more', 'wb').write(b'x' * 2**20)", session_id=sid)
        assert more.error is not None and "No space left" in more.error.message, more
        if image_path(volume).exists():  # seen from the host: its disk gave the image what was planned
            planned = plan(VolumeSize(bytes=QUOTA_MB * MIB, entries=200)).image_bytes
            assert image_path(volume).stat().st_blocks * 512 <= planned + MIB  # and its own extent blocks
    finally:
        await sized.close_session(OWNER, sid)
    assert leftovers([volume]) == []


async def test_a_flood_ends_at_the_filesystem_and_older_files_stay(sized: SandboxService) -> None:
    sid, _ = await new_session(sized)
    flood = "import os\nfd = os.open('big', os.O_CREAT | os.O_WRONLY)\nos.posix_fallocate(fd, 0, 1 << 30)"
    try:
        await sized.write_file(OWNER, sid, "keep.txt", b"older work")
        result = await sized.run(OWNER, flood, session_id=sid, timeout=60)
        assert result.error is not None, result  # ENOSPC at once, or the count's message after it
        assert not result.session_restarted
        kept = await sized.run(OWNER, "open('keep.txt').read()", session_id=sid)
        assert kept.result == "'older work'", kept
    finally:
        await sized.close_session(OWNER, sid)


async def test_a_sparse_file_far_past_the_quota_is_kept(sized: SandboxService) -> None:
    # 200 MiB (three times the quota, under the 256 MiB file size limit) that take almost no disk.
    # gVisor reports them at full size: counted, that looked like a flood, and the count's response
    # stopped the session and removed the file. The filesystem holds the quota, so the count never
    # sheds files (under runc the count sees the real size: this holds either way).
    sid, _ = await new_session(sized)
    sparse = "f = open('sparse.bin', 'wb')\nf.truncate(200 * 2**20)\nf.close()\nmarker = 1"
    try:
        await sized.run(OWNER, sparse, session_id=sid, timeout=60)  # may be told it is over the quota
        after = await sized.run(OWNER, "import os\n(marker, os.path.getsize('sparse.bin'))", session_id=sid)
        assert after.result == f"(1, {200 * MIB})", after
        assert not after.session_restarted
    finally:
        await sized.close_session(OWNER, sid)


async def test_a_sessions_files_survive_its_container_being_replaced(sized: SandboxService) -> None:
    sid, volume = await new_session(sized)
    try:
        await sized.write_file(OWNER, sid, "kept.txt", b"on its own filesystem")
        sandbox = sized.sessions.get(sid, OWNER).sandbox
        assert sandbox is not None
        host("docker", "kill", sandbox.container_id)
        with anyio.fail_after(30):
            await sandbox.channel.closed.wait()  # the host noticed: the attach stream ended
        after = await sized.run(OWNER, "open('kept.txt').read()", session_id=sid)
        assert after.result == "'on its own filesystem'" and after.session_restarted, after
        free = await sized.run(OWNER, STATVFS, session_id=sid)
        assert int(free.result or 0) <= QUOTA_MB * MIB * 1.01 + 8 * MIB  # the same sized filesystem
    finally:
        await sized.close_session(OWNER, sid)
    assert leftovers([volume]) == []


async def test_the_start_up_sweep_removes_the_disk_of_a_volume_that_is_gone() -> None:
    # What a server that died between removing a volume and its disk leaves (or a server that
    # knows nothing of disks, sweeping a dead server's volumes): a disk whose volume is gone.
    config = make_test_config(pool={"size": 1, "session_spares": 0})
    engine = await DockerEngine.connect(config.docker_host, disk_image=config.image)
    name = "mcp-code-exec-" + "0d15c0ca" * 2
    try:
        await engine.create_volume(name, {LABEL_KIND: "test"}, VolumeSize(bytes=16 * MIB, entries=100))
    finally:
        await engine.aclose()
    made.add(name)
    host("docker", "volume", "rm", name)
    assert leftovers([name]) and f"volume {name}" not in leftovers([name])
    async with SandboxService.start(config):
        pass
    assert leftovers([name]) == []
