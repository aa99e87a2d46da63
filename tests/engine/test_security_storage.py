"""Hostile code against the sandbox's storage (docs/security.md#storage): filling the disk,
using up inodes and file descriptors, and leaving traces (files, message queues, shared memory) for the
next stateless run to find.

Every case ends the same way: a clear status or error comes back, the service still answers,
and a following ``print(1)`` in the same place succeeds.
"""

from __future__ import annotations

import anyio
import pytest
from _security import OWNER, assert_answers, stateless_and_session

from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


# -- 12, 13, 14. disk, inodes, descriptors -------------------------------------------------------------
FILL_DISK = (
    "import errno, os\n"
    "def fill(directory):\n"
    "    written = 0\n"
    "    try:\n"
    "        for n in range(100000):\n"
    "            with open(os.path.join(directory, f'big{n}'), 'wb') as handle:\n"
    "                for _ in range(1 << 12):\n"
    "                    handle.write(b'x' * (1 << 20))\n"
    "                    written += 1\n"
    "    except OSError as exc:\n"
    "        print(directory, errno.errorcode[exc.errno], written > 0)\n"
    "for d in DIRS:\n"
    "    fill(d)\n"
)


async def test_filling_tmp_and_data_reports_enospc_and_the_next_run_is_clean(service: SandboxService) -> None:
    code = "DIRS = ['/tmp', '/mnt/data', '/dev/shm']\n" + FILL_DISK
    with anyio.fail_after(60):
        result = await service.run(OWNER, code, timeout=40)
    assert result.status == "ok", result
    for directory in ("/tmp", "/mnt/data", "/dev/shm"):
        assert any(
            line.startswith(directory + " E") and line.endswith(" True") for line in result.stdout.splitlines()
        ), result
        assert f"{directory} ENOSPC" in result.stdout or f"{directory} EFBIG" in result.stdout
    for _ in range(service.config.pool.size + 1):
        check = await service.run(OWNER, "import os; print([os.listdir(d) for d in ('/tmp', '/mnt/data', '/dev/shm')])")
        assert check.stdout == "[[], [], []]\n", check


async def test_filling_tmp_in_a_session_reports_enospc_and_the_session_answers(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        code = "DIRS = ['/tmp', '/dev/shm']\n" + FILL_DISK
        with anyio.fail_after(60):
            result = await service.run(OWNER, code, session_id=sid, timeout=40)
        assert result.status == "ok", result
        assert "/tmp E" in result.stdout and "/dev/shm E" in result.stdout
        await assert_answers(service, sid)
        freed = await service.run(
            OWNER, "import glob, os\nfor f in glob.glob('/tmp/big*'): os.unlink(f)\nprint('ok')", session_id=sid
        )
        assert freed.stdout == "ok\n"
    finally:
        await service.close_session(OWNER, sid)


async def test_a_single_file_over_the_size_limit_gets_efbig(service: SandboxService) -> None:
    code = (
        "import errno\n"
        "with open('/mnt/data/huge', 'wb') as f:\n"
        "    try:\n"
        f"        f.truncate({service.config.limits.fsize_mb + 1} << 20)\n"
        "    except OSError as exc:\n"
        "        print(errno.errorcode[exc.errno])\n"
    )
    result = await service.run(OWNER, code)
    assert result.status == "ok", result
    assert result.stdout == "EFBIG\n"
    await assert_answers(service)


INODES = (
    "import errno, os\n"
    "n = 0\n"
    "try:\n"
    "    while True:\n"
    "        open(f'{DIR}/f{n}', 'w').close()\n"
    "        n += 1\n"
    "except OSError as exc:\n"
    "    print(errno.errorcode[exc.errno], n > 0)\n"
)


async def test_creating_files_until_inodes_run_out_is_an_error(service: SandboxService) -> None:
    with anyio.fail_after(60):
        result = await service.run(OWNER, "DIR = '/tmp'\n" + INODES, timeout=40)
    assert result.status == "ok", result
    assert result.stdout == "ENOSPC True\n"
    for _ in range(service.config.pool.size + 1):
        check = await service.run(OWNER, "import os; print(len(os.listdir('/tmp')))")
        assert check.stdout == "0\n", check


async def test_list_files_stays_usable_over_a_huge_directory(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        made = await service.run(
            OWNER,
            # Under the session's quota of 10,000 entries: more would end the run as over quota
            # (at its next periodic check, or at its end), which is not what this test is about.
            "import os\nos.makedirs('many')\nfor n in range(9000): open(f'many/f{n}', 'w').close()\nprint('made')",
            session_id=sid,
            timeout=40,
        )
        assert service.config.limits.session_max_files >= 9001
        assert made.status == "ok" and made.stdout == "made\n", made
        assert len(made.files) <= 2000  # the changed-files report is bounded too
        with anyio.fail_after(30):
            entries, truncated = await service.list_files(OWNER, sid, ".", limit=100)
        assert truncated and len(entries) == 100
        with anyio.fail_after(30):
            entries, truncated = await service.list_files(OWNER, sid, "many", limit=5000)
        assert truncated and len(entries) == 5000
        await assert_answers(service, sid)
    finally:
        await service.close_session(OWNER, sid)


async def test_opening_files_without_end_gets_emfile(service: SandboxService) -> None:
    code = (
        "import errno\n"
        "held = []\n"
        "try:\n"
        "    for _ in range(10**6):\n"
        "        held.append(open('/dev/null'))\n"
        "except OSError as exc:\n"
        "    print(errno.errorcode[exc.errno], len(held) < 10**6)\n"
    )
    async with stateless_and_session(service) as places:
        for session_id in places:
            result = await service.run(OWNER, code, session_id=session_id)
            assert result.status == "ok", result
            assert result.stdout == "EMFILE True\n"
            await assert_answers(service, session_id)


# -- 16. nothing carries over between stateless runs -------------------------------------------------
PLACES = ("/tmp", "/dev/shm", "/var/tmp", "/mnt/data", "/dev/mqueue", "/run/mcpx", "/run", "/var/lock", "/home", "/")
LEAVE_TRACES = (
    "import ctypes, os\n"
    "placed = []\n"
    f"for d in {PLACES!r}:\n"
    "    try:\n"
    "        open(os.path.join(d, '.trace'), 'w').write('x')\n"
    "        placed.append(d)\n"
    "    except OSError:\n"
    "        pass\n"
    "rt = ctypes.CDLL('librt.so.1', use_errno=True)\n"
    "rt.mq_open.restype = ctypes.c_int\n"
    "if rt.mq_open(b'/trace-mq', os.O_CREAT | os.O_RDWR, 0o600, None) >= 0:\n"
    "    placed.append('mq')\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.shmget(0x7ace, 4096, 0o1600) >= 0:\n"
    "    placed.append('sysv')\n"
    "print(placed)\n"
)
FIND_TRACES = (
    "import ctypes, os\n"
    f"found = [d for d in {PLACES!r} if os.path.lexists(os.path.join(d, '.trace'))]\n"
    "found += [f'/dev/mqueue/{n}' for n in (os.listdir('/dev/mqueue') if os.path.isdir('/dev/mqueue') else [])]\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "if libc.shmget(0x7ace, 0, 0) >= 0:\n"
    "    found.append('sysv')\n"
    "print(found)\n"
)


async def test_nothing_a_stateless_run_leaves_anywhere_is_seen_by_the_next(service: SandboxService) -> None:
    placed = await service.run(OWNER, LEAVE_TRACES)
    assert placed.status == "ok", placed
    assert "'/tmp'" in placed.stdout  # it did manage to write somewhere
    for _ in range(service.config.pool.size + 1):
        found = await service.run(OWNER, FIND_TRACES)
        assert found.stdout == "[]\n", found
