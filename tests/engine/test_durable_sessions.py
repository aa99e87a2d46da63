"""Durable sessions on the real engine: a paused session gives its container back and resumes with
its files; a hundred paused sessions hold no container; forks are independent copies (sized ones
too), symbolic links are copied as links, and no copy helper is left behind.

Servers that stop and start again are in test_durable_restart.py; the tools over MCP in
test_durable_tools.py.
"""

from __future__ import annotations

import logging
import re
import time
from collections.abc import AsyncIterator

import pytest
from _durable import (
    OWNER,
    copy_helpers,
    docker,
    durable_config,
    durable_service,
    host,
    session_containers,
)
from _support import wait_until

from mcp_code_exec.runtime.base import LABEL_INSTANCE, LABEL_KIND
from mcp_code_exec.sandbox.ownership import RECORD_KIND
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
log = logging.getLogger(__name__)
RESUMED = re.compile(r"the session was paused; it resumed in \d+\.\d s")


@pytest.fixture(scope="module")
async def service() -> AsyncIterator[SandboxService]:
    """A durable service of this module's own (not the suite's shared one, which is not durable)."""
    async with durable_service(durable_config(sessions={"max_paused": 110, "max_paused_per_client": 110})) as running:
        yield running


async def run_ok(service: SandboxService, code: str, session_id: str) -> str:
    result = await service.run(OWNER, code, session_id=session_id)
    assert result.status == "ok", result
    return result.stdout


async def test_an_idle_session_gives_its_container_back_and_resumes_at_its_next_call_with_its_files() -> None:
    async with durable_service(durable_config(sessions={"pause_after_s": 1})) as service:
        session_id = (await service.new_session(OWNER)).session_id
        await run_ok(service, "open('/mnt/data/kept.txt', 'w').write('still here')", session_id)
        await wait_until(lambda: session_containers(service) == [], 60, every_s=0.5)
        assert service.sessions.get(session_id, OWNER).paused
        began = time.monotonic()
        result = await service.run(OWNER, "print(open('/mnt/data/kept.txt').read())", session_id=session_id)
        log.warning("resume of a paused session, from the call to its result: %.2f s", time.monotonic() - began)
        assert result.status == "ok" and result.stdout == "still here\n", result
        assert any(RESUMED.fullmatch(note) for note in result.notes), result.notes
        assert len(session_containers(service)) == 1


async def test_a_hundred_paused_sessions_hold_no_container_only_their_volumes(service: SandboxService) -> None:
    source = (await service.new_session(OWNER)).session_id
    await run_ok(service, "open('/mnt/data/seed.txt', 'w').write('seed')", source)
    began = time.monotonic()
    forks: list[str] = []
    while len(forks) < 100:
        forks += await service.fork_session(OWNER, source, min(8, 100 - len(forks)))
    log.warning("100 forks of a small session: %.1f s", time.monotonic() - began)
    assert await service.keeper.pause(service.sessions.get(source, OWNER))
    try:
        assert session_containers(service) == []
        instance = f"label={LABEL_INSTANCE}={service.instance}"
        records = docker("volume", "ls", "-q", "--filter", instance, "--filter", f"label={LABEL_KIND}={RECORD_KIND}")
        assert len(records.split()) == 101
        assert await run_ok(service, "print(open('/mnt/data/seed.txt').read())", forks[57]) == "seed\n"
    finally:
        for session_id in [source, *forks]:
            await service.close_session(OWNER, session_id)


async def test_forks_go_their_own_way(service: SandboxService) -> None:
    parent = (await service.new_session(OWNER)).session_id
    await run_ok(service, "open('/mnt/data/shared.txt', 'w').write('parent')", parent)
    first, second = await service.fork_session(OWNER, parent, 2)
    try:
        await run_ok(service, "open('/mnt/data/shared.txt', 'w').write('first')", first)
        await run_ok(service, "open('/mnt/data/only-second.txt', 'w').write('2')", second)
        show = "import os; print(open('/mnt/data/shared.txt').read(), sorted(set(os.listdir('/mnt/data')) - {'.mcpx'}))"
        assert await run_ok(service, show, parent) == "parent ['shared.txt']\n"
        assert await run_ok(service, show, first) == "first ['shared.txt']\n"
        assert await run_ok(service, show, second) == "parent ['only-second.txt', 'shared.txt']\n"
    finally:
        for session_id in (parent, first, second):
            await service.close_session(OWNER, session_id)


PLANT = """
import os
os.symlink('/etc/passwd', '/mnt/data/passwd')
os.symlink('/etc', '/mnt/data/etc')
os.symlink('../../../proc/1/root/etc/shadow', '/mnt/data/escape')
os.makedirs('/mnt/data/sub')
os.symlink('/tmp/not-in-the-volume', '/mnt/data/sub/dangling')
os.mkfifo('/mnt/data/pipe')  # a copy that opened it would wait for a writer forever
"""
LOOK = """
import os
for name in ('passwd', 'etc', 'escape', 'sub/dangling'):
    path = '/mnt/data/' + name
    print(name, os.path.islink(path), os.readlink(path))
print(sorted(set(os.listdir('/mnt/data')) - {'.mcpx'}), os.listdir('/mnt/data/sub'))
import stat
print('pipe', stat.S_ISFIFO(os.lstat('/mnt/data/pipe').st_mode))
"""


async def test_a_fork_copies_symbolic_links_as_links_and_pipes_as_pipes_never_what_they_lead_to(
    service: SandboxService,
) -> None:
    parent = (await service.new_session(OWNER)).session_id
    await run_ok(service, PLANT, parent)
    (fork,) = await service.fork_session(OWNER, parent)
    try:
        assert (await run_ok(service, LOOK, fork)).splitlines() == [
            "passwd True /etc/passwd",
            "etc True /etc",
            "escape True ../../../proc/1/root/etc/shadow",
            "sub/dangling True /tmp/not-in-the-volume",
            "['escape', 'etc', 'passwd', 'pipe', 'sub'] ['dangling']",
            "pipe True",
        ]
    finally:
        await service.close_session(OWNER, fork)
        await service.close_session(OWNER, parent)


async def test_no_copy_helper_outlives_a_fork(service: SandboxService) -> None:
    parent = (await service.new_session(OWNER)).session_id
    (fork,) = await service.fork_session(OWNER, parent)
    try:
        assert copy_helpers(service.instance) == []
    finally:
        await service.close_session(OWNER, fork)
        await service.close_session(OWNER, parent)


FILES_100MB = """
import os
os.makedirs('/mnt/data/set', exist_ok=True)
for i in range(10):
    with open(f'/mnt/data/set/part{i}.bin', 'wb') as out:
        out.write(os.urandom(10 * 1024 * 1024))
"""
DIGEST = """
import hashlib, pathlib
digest = hashlib.sha256()
for part in sorted(pathlib.Path('/mnt/data/set').iterdir()):
    digest.update(part.read_bytes())
print(digest.hexdigest())
"""


async def test_a_fork_of_a_session_with_100_mb_of_files_holds_the_same_bytes() -> None:
    config = durable_config(limits={"session_data_mb": 160, "fsize_mb": 16})
    async with durable_service(config) as service:
        parent = (await service.new_session(OWNER)).session_id
        await run_ok(service, FILES_100MB, parent)
        began = time.monotonic()
        (fork,) = await service.fork_session(OWNER, parent)
        log.warning("fork of a session with 100 MB of files: %.2f s", time.monotonic() - began)
        assert await run_ok(service, DIGEST, fork) == await run_ok(service, DIGEST, parent)


async def test_a_fork_of_a_sized_session_is_a_filesystem_of_the_same_size_with_the_same_files() -> None:
    limits = {"session_data_mb": 32, "session_max_files": 100, "session_disk": "filesystem"}
    async with durable_service(durable_config(limits=limits)) as service:
        parent = (await service.new_session(OWNER)).session_id
        await run_ok(service, "open('/mnt/data/a.txt', 'w').write('sized')", parent)
        (fork,) = await service.fork_session(OWNER, parent)
        fork_volume = service.sessions.get(fork, OWNER).volume
        size = "import os; st = os.statvfs('/mnt/data'); print(round(st.f_blocks * st.f_frsize / 2**20))"
        assert await run_ok(service, size, fork) == await run_ok(service, size, parent)
        assert await run_ok(service, "print(open('/mnt/data/a.txt').read())", fork) == "sized\n"
        fill = "open('/mnt/data/fill', 'wb').write(b'x' * 40 * 2**20)"  # past the quota: the filesystem's end
        result = await service.run(OWNER, fill, session_id=fork)
        written = {file.path: file.size for file in result.files}
        assert result.status == "error" and written["fill"] < 40 * 2**20, result
    assert fork_volume is not None and f"{fork_volume}.img" not in host("losetup", "-a")
