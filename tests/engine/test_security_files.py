"""Hostile paths, symlinks and sizes against the file tools (docs/security.md#file-tools)."""

from __future__ import annotations

import base64
import contextlib
import gzip
import json
from collections.abc import AsyncIterator

import anyio
import pytest
from _security import OWNER, assert_answers
from mcp import Client

from mcp_code_exec.errors import FileOperationError, InvalidPath, SandboxError
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.protocol import messages as wire
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio


@pytest.fixture
async def sid(service: SandboxService) -> AsyncIterator[str]:
    session = await service.new_session(OWNER)
    try:
        yield session.session_id
    finally:
        await service.close_session(OWNER, session.session_id)


async def listing(service: SandboxService, sid: str, path: str = ".") -> list[str]:
    entries, _ = await service.list_files(OWNER, sid, path)
    return sorted(e.path for e in entries)


# -- 27. malformed and escaping paths ------------------------------------------------------------------
BAD_PATHS = [
    "..",
    "../etc/passwd",
    "../../../../../../etc/shadow",
    "/etc/passwd",
    "/mnt/data/../etc/passwd",
    "/mnt/datax/file",
    "/mnt/data/../../proc/1/environ",
    "a/../../b",
    "./../x",
    "x/./../../y",
    "%2e%2e/etc/passwd",
    "%2E%2E%2Fetc%2Fpasswd",
    "..%2f..%2fetc%2fpasswd",
    "x\x00y",
    "x\x00/../../etc/passwd",
    "a\\b",
    "..\\..\\etc\\passwd",
    "a" * 300,
    ("d" * 200 + "/") * 6 + "f",
    " ../x",
    "/proc/self/environ",
    "/run/mcpx/x",
]


async def test_escaping_or_malformed_paths_are_refused_and_nothing_is_touched(
    service: SandboxService, sid: str
) -> None:
    for bad in BAD_PATHS:
        with pytest.raises(InvalidPath):
            await service.write_file(OWNER, sid, bad, b"pwned")
        with pytest.raises(InvalidPath):
            await service.read_file(OWNER, sid, bad)
        if bad.strip("/") != "mnt/data":
            with pytest.raises(InvalidPath):
                await service.list_files(OWNER, sid, bad)
    assert await listing(service, sid) == []
    await assert_answers(service, sid)


async def test_the_agent_refuses_bad_paths_even_when_the_host_check_is_skipped(
    service: SandboxService, sid: str
) -> None:
    """Defence in depth: the agent's own walk refuses what the host would have refused."""
    session = service.sessions.get(sid, OWNER)
    assert session.sandbox is not None
    for bad in ("../etc/passwd", "/etc/passwd", "a/../../etc/passwd", "x\x00y", "a\\b", "a" * 300):
        requests = (
            wire.ReadChunk(path=bad, offset=0, length=1 << 20),
            wire.WriteChunk(upload="0" * 32, path=bad, offset=0, final=True),
            wire.ListFiles(path=bad, limit=10),
        )
        for request in requests:
            with pytest.raises(FileOperationError):
                await session.sandbox.request(request, b"pwned")
    assert await listing(service, sid) == []


# -- 28. symlinks and other special files planted by user code ---------------------------------------
PLANT = (
    "import os\n"
    "os.symlink('/etc/passwd', 'passwd')\n"
    "os.symlink('/', 'root')\n"
    "os.symlink('/proc/1/environ', 'init-env')\n"
    "os.symlink('/run/mcpx', 'private')\n"
    "os.symlink('/tmp', 'tmpdir')\n"
    "os.symlink('missing-target', 'dangling')\n"
    "os.makedirs('real/sub')\n"
    "os.symlink('../..', 'real/sub/up')\n"
    "os.mkfifo('fifo')\n"
    "open('/tmp/outside.txt', 'w').write('outside')\n"
    "open('locked.txt', 'w').write('secret'); os.chmod('locked.txt', 0)\n"
    "print('planted')\n"
)


async def test_symlinks_planted_by_user_code_are_never_followed(service: SandboxService, sid: str) -> None:
    assert (await service.run(OWNER, PLANT, session_id=sid)).stdout == "planted\n"
    refused_reads = [
        "passwd",
        "root/etc/passwd",
        "init-env",
        "private/mpl/fontlist.json",
        "tmpdir/outside.txt",
        "dangling",
        "real/sub/up/passwd",
        "fifo",
        "locked.txt",
        "root",
        "real",
    ]
    for path in refused_reads:
        with anyio.fail_after(10), pytest.raises(SandboxError):  # a FIFO must not hang the agent either
            await service.read_file(OWNER, sid, path)
    refused_writes = [
        "passwd",
        "root/tmp/x",
        "tmpdir/outside.txt",
        "tmpdir/new.txt",
        "dangling",
        "real/sub/up/x",
        "fifo",
        "root",
    ]
    for path in refused_writes:
        with anyio.fail_after(10), pytest.raises(SandboxError):
            await service.write_file(OWNER, sid, path, b"pwned")
    for path in ("root", "tmpdir", "real/sub/up", "private"):
        with pytest.raises(SandboxError):
            await service.list_files(OWNER, sid, path)
    entries, _ = await service.list_files(OWNER, sid)
    notes = {e.path: e.note for e in entries}
    assert notes["root"] == notes["passwd"] == "symlink (not followed)"
    assert not any(e.path.startswith(("root/", "tmpdir/", "real/sub/up/")) for e in entries)
    check = await service.run(
        OWNER,
        "import os\n"
        "print(open('/tmp/outside.txt').read(), os.readlink('passwd'), os.readlink('dangling'),"
        " os.path.exists('missing-target'), sorted(os.listdir('/tmp')))",
        session_id=sid,
    )
    assert check.stdout == "outside /etc/passwd missing-target False ['outside.txt']\n", check
    await assert_answers(service, sid)


async def test_file_tools_act_with_the_sandbox_users_rights_only(service: SandboxService, sid: str) -> None:
    info = await service.write_file(OWNER, sid, "mine/written.txt", b"hello")
    assert info.path == "mine/written.txt"
    owners = await service.run(
        OWNER,
        "import os; print(os.getuid(), os.stat('mine').st_uid, os.stat('mine/written.txt').st_uid)",
        session_id=sid,
    )
    uid, *made_by = owners.stdout.split()
    assert made_by == [uid, uid] and uid != "0", owners  # created as the sandbox user, not as root
    made = await service.run(
        OWNER,
        "import os; os.mkdir('shut'); open('shut/f', 'w').write('x'); os.chmod('shut', 0); print('ok')",
        session_id=sid,
    )
    assert made.stdout == "ok\n"
    with pytest.raises(SandboxError, match="permission denied"):
        await service.read_file(OWNER, sid, "shut/f")
    with pytest.raises(SandboxError):
        await service.write_file(OWNER, sid, "shut/g", b"x")


async def test_a_symlink_swapped_in_for_a_directory_during_writes_never_leads_outside(
    service: SandboxService, sid: str
) -> None:
    """A background process keeps swapping a directory and a symlink to /tmp while files are written."""
    swapper = (
        "import os, subprocess, sys\n"
        "code = '''\n"
        "import os, time\n"
        "os.chdir('/mnt/data')\n"
        "end = time.time() + 8\n"
        "while time.time() < end:\n"
        "    try:\n"
        "        os.rename('d', 'd.real'); os.symlink('/tmp', 'd')\n"
        "        os.unlink('d'); os.rename('d.real', 'd')\n"
        "    except OSError:\n"
        "        pass\n"
        "'''\n"
        "os.makedirs('d', exist_ok=True)\n"
        "subprocess.Popen([sys.executable, '-c', code], start_new_session=True)\n"
        "print('swapping')\n"
    )
    assert (await service.run(OWNER, swapper, session_id=sid)).stdout == "swapping\n"
    for n in range(200):
        with contextlib.suppress(SandboxError):
            await service.write_file(OWNER, sid, f"d/f{n}", b"x")
    leaked = await service.run(OWNER, "import glob; print(glob.glob('/tmp/f*'))", session_id=sid, timeout=30)
    assert leaked.stdout == "[]\n", leaked


# -- 29. files over the read cap -------------------------------------------------------------------------
async def test_a_file_over_the_read_cap_is_refused_without_being_read(service: SandboxService, sid: str) -> None:
    cap = service.config.limits.read_max_bytes
    made = await service.run(
        OWNER,
        f"open('big.bin', 'wb').write(b'x' * ({cap} + 1))\n"
        f"with open('sparse.bin', 'wb') as f: f.truncate(200 << 20)\n"
        "print('ok')",
        session_id=sid,
    )
    assert made.stdout == "ok\n", made
    for path in ("big.bin", "sparse.bin"):
        with anyio.fail_after(10), pytest.raises(FileOperationError, match="over the read cap"):
            await service.read_file(OWNER, sid, path)
    await service.run(OWNER, f"open('exact.bin', 'wb').write(b'y' * {cap})", session_id=sid)
    content = await service.read_file(OWNER, sid, "exact.bin")
    assert content.size == cap and len(content.data) == cap
    await assert_answers(service, sid)


async def test_stateless_files_over_the_keep_cap_are_listed_but_not_kept(service: SandboxService) -> None:
    per_file = service.config.runs.files_max_file_bytes
    result = await service.run(
        OWNER, f"open('big.bin', 'wb').write(b'x' * ({per_file} + 1)); open('small.txt', 'w').write('s')"
    )
    assert result.status == "ok", result
    by_path = {f.path: f for f in result.files}
    assert by_path["big.bin"].uri is None and by_path["big.bin"].note
    assert by_path["small.txt"].uri is not None
    await assert_answers(service)


# -- 30. writes over the cap, invalid content -------------------------------------------------------------
async def test_a_write_over_the_cap_is_refused_and_the_old_file_is_intact(service: SandboxService, sid: str) -> None:
    cap = service.config.limits.write_max_bytes
    await service.write_file(OWNER, sid, "keep.txt", b"original")
    with pytest.raises(FileOperationError, match="over the write cap"):
        await service.write_file(OWNER, sid, "keep.txt", b"x" * (cap + 1))
    with pytest.raises(FileOperationError, match="over the write cap"):
        await service.write_file(OWNER, sid, "new.txt", b"x" * (cap + 1))
    assert (await service.read_file(OWNER, sid, "keep.txt")).data == b"original"
    assert await listing(service, sid) == ["keep.txt"]  # no temporary file left either
    await assert_answers(service, sid)


async def test_a_write_that_fails_midway_leaves_nothing_half_written(service: SandboxService, sid: str) -> None:
    """Fill the session's /mnt/data's file-size limit: the write fails, the old content stays."""
    await service.write_file(OWNER, sid, "keep.txt", b"original")
    await service.run(
        OWNER, "import os; os.mkdir('ro'); open('ro/f', 'w').write('old'); os.chmod('ro', 0o555)", session_id=sid
    )
    with pytest.raises(FileOperationError):
        await service.write_file(OWNER, sid, "ro/f", b"new")
    check = await service.run(OWNER, "import os; print(open('ro/f').read(), os.listdir('ro'))", session_id=sid)
    assert check.stdout == "old ['f']\n", check


async def test_invalid_base64_over_mcp_is_a_clear_error_and_nothing_is_written(service: SandboxService) -> None:
    server = build_server(service)
    with anyio.fail_after(60):
        async with Client(server) as client:
            opened = await client.call_tool("new_session", {})
            assert not opened.is_error, opened
            session_id = (opened.structured_content or {}).get("session_id")
            assert isinstance(session_id, str)
            try:
                for bad in ("not base64!!", "QU=JD", "QUJ", "Q" * 5 + "\x00", "4pyTIMOgIGxhIG1vZGU=\n%%"):
                    result = await client.call_tool(
                        "write_file", {"session_id": session_id, "path": "x.bin", "content": bad, "encoding": "base64"}
                    )
                    assert result.is_error, result
                    text = " ".join(getattr(block, "text", "") for block in result.content)
                    assert "base64" in text and "nothing was written" in text
                big = base64.b64encode(b"x" * (service.config.limits.write_max_bytes + 1)).decode()
                result = await client.call_tool(
                    "write_file", {"session_id": session_id, "path": "x.bin", "content": big, "encoding": "base64"}
                )
                assert result.is_error and "write cap" in json.dumps([b.model_dump() for b in result.content])
                listed = await client.call_tool("list_files", {"session_id": session_id})
                assert not listed.is_error
                assert (listed.structured_content or {}).get("entries") == []
            finally:
                await client.call_tool("close_session", {"session_id": session_id})


# -- 31. compressed files ---------------------------------------------------------------------------------
async def test_a_compressed_file_is_returned_as_is_never_decompressed(service: SandboxService, sid: str) -> None:
    bomb = gzip.compress(b"\0" * (64 << 20), compresslevel=9)  # 64 MiB of zeros in about 64 KiB
    await service.write_file(OWNER, sid, "bomb.gz", bomb)
    content = await service.read_file(OWNER, sid, "bomb.gz")
    assert content.data == bomb and content.size == len(bomb)
    made = await service.run(
        OWNER,
        "import zipfile\n"
        "with zipfile.ZipFile('bomb.zip', 'w', zipfile.ZIP_DEFLATED) as z:\n"
        "    z.writestr('z', b'0' * (64 << 20))",
        session_id=sid,
    )
    assert made.status == "ok", made
    zipped = await service.read_file(OWNER, sid, "bomb.zip")
    assert zipped.data[:2] == b"PK" and zipped.size < 1 << 20
