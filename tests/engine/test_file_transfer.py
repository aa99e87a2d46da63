"""Files of any size in and out of a session: upload and download URLs of a real HTTP server (a
subprocess, whose memory is read from /proc), and chunked streams through the service API."""

from __future__ import annotations

import hashlib
import json
import os
import time
from collections.abc import AsyncIterator
from contextlib import AbstractAsyncContextManager, asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from _support import ServerProcess, client_with_token, make_test_config, structured_call, wait_until
from mcp import Client

from mcp_code_exec.commands.bench.report import config_for_subprocess, to_toml
from mcp_code_exec.errors import QuotaExceeded, TooLarge
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
MIB = 1 << 20
TOKENS = {"alice": "alice-files-7d1e", "bob": "bob-files-02c9"}
OWNER = "transfer"


def server_config(path: Path, **overrides: Any) -> Path:
    config = make_test_config(pool={"size": 1, "session_spares": 1}, **overrides)
    tokens = "".join(f'{name} = "{token}"\n' for name, token in TOKENS.items())
    path.write_text(to_toml(config_for_subprocess(config)) + "\n[http.tokens]\n" + tokens)
    return path


@pytest.fixture(scope="module")
async def roomy(service: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServerProcess]:
    """A server with the default [files] settings (the suite's shared service is set up first)."""
    path = server_config(tmp_path_factory.mktemp("roomy") / "config.toml")
    async with ServerProcess("streamable-http", args=["--config", str(path)]) as running:
        yield running


@pytest.fixture(scope="module")
async def tight(service: Any, tmp_path_factory: pytest.TempPathFactory) -> AsyncIterator[ServerProcess]:
    """URLs that expire after 2 s, a 16 MiB session quota, uploads of at most 24 MiB."""
    path = server_config(
        tmp_path_factory.mktemp("tight") / "config.toml",
        limits={"session_data_mb": 16},
        files={"url_ttl_s": 2, "max_upload_mb": 24},
    )
    async with ServerProcess("streamable-http", args=["--config", str(path)]) as running:
        yield running


def connect(server: ServerProcess, who: str = "alice") -> AbstractAsyncContextManager[Client]:
    return client_with_token(server, TOKENS[who])


call = structured_call


@asynccontextmanager
async def session(client: Client) -> AsyncIterator[str]:
    sid = str((await call(client, "new_session"))["session_id"])
    try:
        yield sid
    finally:
        await client.call_tool("close_session", {"session_id": sid})


async def url(client: Client, sid: str, path: str, direction: str) -> str:
    return str((await call(client, "file_url", session_id=sid, path=path, direction=direction))["url"])


async def names(client: Client, sid: str) -> list[str]:
    code = "import json, os; print(json.dumps(sorted(set(os.listdir('/mnt/data')) - {'.mcpx'})))"
    listed = await call(client, "run_python", code=code, session_id=sid)
    return list(json.loads(listed["stdout"]))


def memory_kib(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(f"{field}:"):
            return int(line.split()[1])
    raise LookupError(field)


async def read_chunks(path: Path, size: int = MIB) -> AsyncIterator[bytes]:
    async with await anyio.open_file(path, "rb") as handle:
        while chunk := await handle.read(size):
            yield chunk


async def test_a_200_mib_file_goes_in_and_out_through_urls_intact_while_server_memory_stays_flat(
    roomy: ServerProcess, tmp_path: Path
) -> None:
    size = 200 * MIB
    source, digest = tmp_path / "big.bin", hashlib.sha256()
    with source.open("wb") as handle:  # random bytes, never held whole here either
        for _ in range(size // MIB):
            block = os.urandom(MIB)
            digest.update(block)
            handle.write(block)
    pid = roomy.process.pid
    at_start = memory_kib(pid, "VmRSS")
    await anyio.Path(f"/proc/{pid}/clear_refs").write_text("5")  # the peak (VmHWM) counts from here
    async with connect(roomy) as client, session(client) as sid:
        peak = at_start
        async with anyio.create_task_group() as tg:

            async def sample() -> None:
                nonlocal peak
                while True:
                    peak = max(peak, memory_kib(pid, "VmRSS"))
                    await anyio.sleep(0.05)  # the sampling rate of a measurement, not a synchronisation

            tg.start_soon(sample)
            async with httpx2.AsyncClient(timeout=120) as http:
                started = time.perf_counter()
                put = await http.put(
                    await url(client, sid, "big.bin", "upload"),
                    content=read_chunks(source),
                    headers={"Content-Length": str(size)},
                )
                upload_s = time.perf_counter() - started
                assert put.status_code == 201, put.text
                assert put.json()["size"] == size
                download_url = await url(client, sid, "big.bin", "download")
                started, received, back = time.perf_counter(), 0, hashlib.sha256()
                async with http.stream("GET", download_url) as got:
                    assert got.status_code == 200 and got.headers["content-length"] == str(size)
                    async for part in got.aiter_bytes():
                        received += len(part)
                        back.update(part)
                download_s = time.perf_counter() - started
            tg.cancel_scope.cancel()
        peak = max(peak, memory_kib(pid, "VmHWM"))
        assert received == size and back.hexdigest() == digest.hexdigest()
        assert await names(client, sid) == ["big.bin"]  # no staging file left
    grew_mib = (peak - at_start) / 1024
    print(
        f"\n200 MiB: upload {upload_s:.2f} s ({size / MIB / upload_s:.0f} MiB/s), download {download_s:.2f} s "
        f"({size / MIB / download_s:.0f} MiB/s); server RSS {at_start / 1024:.1f} MiB at start, "
        f"peak {peak / 1024:.1f} MiB (+{grew_mib:.1f} MiB)"
    )
    assert grew_mib < 50


async def test_an_expired_url_is_refused(tight: ServerProcess) -> None:
    async with connect(tight) as client, session(client) as sid:
        await call(client, "write_file", session_id=sid, path="a.txt", content="hello")
        download = await url(client, sid, "a.txt", "download")
        first = await anyio.to_thread.run_sync(lambda: httpx2.get(download, timeout=10))
        assert first.status_code == 200 and first.content == b"hello"  # within its 2 s
        await wait_until(lambda: httpx2.get(download, timeout=10).status_code == 403, 20, every_s=0.25)
        refused = await anyio.to_thread.run_sync(lambda: httpx2.get(download, timeout=10))
        assert "expired" in refused.text


async def test_an_unknown_token_is_not_found_and_no_bearer_token_is_needed_for_a_real_one(
    roomy: ServerProcess,
) -> None:
    async with httpx2.AsyncClient(base_url=roomy.url, timeout=30) as http:
        for made_up in ("A" * 43, "short", "%2e%2e%2fetc"):
            assert (await http.get(f"/files/{made_up}")).status_code == 404
            assert (await http.put(f"/files/{made_up}", content=b"x")).status_code == 404
        async with connect(roomy) as client, session(client) as sid:
            upload = await url(client, sid, "in.txt", "upload")
            assert upload.startswith(f"{roomy.url}/files/")
            wrong_host = await http.put(upload, content=b"x", headers={"Host": "evil.example"})
            assert wrong_host.status_code == 421  # the Host/Origin checks apply here too (and spend nothing)
            assert (await http.put(upload, content=b"no auth header")).status_code == 201
            assert await names(client, sid) == ["in.txt"]


async def test_an_upload_url_works_once(roomy: ServerProcess) -> None:
    async with connect(roomy) as client, session(client) as sid, httpx2.AsyncClient(timeout=30) as http:
        upload = await url(client, sid, "once.txt", "upload")
        assert (await http.put(upload, content=b"first")).status_code == 201
        again = await http.put(upload, content=b"second")
        assert again.status_code == 403 and "used already" in again.text
        read = await client.call_tool("read_file", {"session_id": sid, "path": "once.txt"})
        assert getattr(read.content[0], "text", None) == "first"


async def test_a_url_for_one_session_writes_to_that_session_only(roomy: ServerProcess) -> None:
    # URLs that outlive the closes (a session volume takes a moment to remove): 404 is for the
    # closed session, not for an expired URL (403).
    async with connect(roomy, "alice") as alice, connect(roomy, "bob") as bob, httpx2.AsyncClient(timeout=30) as http:
        async with session(alice) as mine, session(alice) as other, session(bob) as theirs:
            upload = await url(alice, mine, "shared.txt", "upload")
            assert (await http.put(upload, content=b"for mine")).status_code == 201
            assert await names(alice, mine) == ["shared.txt"]
            assert await names(alice, other) == [] and await names(bob, theirs) == []
            stolen = await bob.call_tool("file_url", {"session_id": mine, "path": "x", "direction": "download"})
            assert stolen.is_error and "no such session" in str(stolen.content[0])
            download = await url(alice, mine, "shared.txt", "download")
        closed = await http.get(download)  # the session is gone, and its URLs with it
        assert closed.status_code == 404


async def test_uploads_over_the_quota_or_the_cap_fail_cleanly_and_leave_nothing(tight: ServerProcess) -> None:
    async with connect(tight) as client, session(client) as sid, httpx2.AsyncClient(timeout=60) as http:
        announced = await http.put(await url(client, sid, "over.bin", "upload"), content=b"x" * (20 * MIB))
        assert announced.status_code == 507 and "quota" in announced.text

        async def unannounced() -> AsyncIterator[bytes]:  # no Content-Length: refused midway
            for _ in range(20):
                yield b"y" * MIB

        try:
            answer = await http.put(await url(client, sid, "over.bin", "upload"), content=unannounced())
        except httpx2.TransportError:
            pass  # the server answered and closed the connection while the body was still coming
        else:
            assert answer.status_code == 507, answer.text
        capped = await http.put(await url(client, sid, "big.bin", "upload"), content=b"z" * (25 * MIB))
        assert capped.status_code == 413 and "upload cap" in capped.text
        assert await names(client, sid) == []  # neither a partial file nor a staging file
        fits = await http.put(await url(client, sid, "fits.bin", "upload"), content=b"f" * (10 * MIB))
        assert fits.status_code == 201 and await names(client, sid) == ["fits.bin"]


async def test_an_upload_the_client_abandons_midway_leaves_nothing(roomy: ServerProcess) -> None:
    async with connect(roomy) as client, session(client) as sid, httpx2.AsyncClient(timeout=60) as http:
        upload = await url(client, sid, "half.bin", "upload")
        sent = anyio.Event()

        async def stalls() -> AsyncIterator[bytes]:
            for _ in range(3):
                yield b"h" * MIB
            sent.set()
            await anyio.sleep_forever()
            yield b""

        async with anyio.create_task_group() as tg:
            tg.start_soon(lambda: http.put(upload, content=stalls(), headers={"Content-Length": str(10 * MIB)}))
            with anyio.fail_after(30):
                await sent.wait()
            tg.cancel_scope.cancel()  # the connection closes mid-body
        with anyio.fail_after(30):  # the server aborts the upload, then the session answers again
            assert await names(client, sid) == []


async def test_files_over_the_tools_caps_stream_through_the_service_api(service: SandboxService) -> None:
    size = 24 * MIB + 123
    assert size > service.config.limits.read_max_bytes and size > service.config.limits.write_max_bytes
    sid = (await service.new_session(OWNER)).session_id
    try:
        digest = hashlib.sha256()

        async def source() -> AsyncIterator[bytes]:
            for start in range(0, size, 3 * MIB):
                block = os.urandom(min(3 * MIB, size - start))
                digest.update(block)
                yield block

        info = await service.write_stream(OWNER, sid, "data/large.bin", source(), max_bytes=size)
        assert info.size == size and info.uri is not None
        with pytest.raises(TooLarge, match="over the read cap"):
            await service.read_file(OWNER, sid, "data/large.bin")
        back = hashlib.sha256()
        async with service.read_stream(OWNER, sid, "data/large.bin") as found:
            assert found.size == size
            async for part in found.chunks():
                back.update(part)
        assert back.hexdigest() == digest.hexdigest()
        entries, _ = await service.list_files(OWNER, sid)
        assert sorted(e.path for e in entries) == ["data", "data/large.bin"]
        with pytest.raises(TooLarge):
            await service.write_stream(OWNER, sid, "data/large.bin", source(), max_bytes=size - 1)
        async with service.read_stream(OWNER, sid, "data/large.bin") as kept:
            assert kept.size == size  # the refused write left the file as it was
    finally:
        await service.close_session(OWNER, sid)


async def test_an_upload_announced_over_the_quota_is_refused_before_a_byte_is_staged(
    service: SandboxService,
) -> None:
    quota = service.config.limits.session_data_bytes
    sid = (await service.new_session(OWNER)).session_id
    try:

        async def never() -> AsyncIterator[bytes]:
            raise AssertionError("nothing is read from the source")
            yield b""

        with pytest.raises(QuotaExceeded, match="nothing was written"):
            await service.write_stream(OWNER, sid, "q.bin", never(), max_bytes=2 * quota, expected_size=quota + 1)
        listed = await service.run(
            OWNER, "import os; print(sorted(set(os.listdir('/mnt/data')) - {'.mcpx'}))", session_id=sid
        )
        assert listed.stdout == "[]\n", listed
    finally:
        await service.close_session(OWNER, sid)


async def test_staging_files_a_dead_container_left_are_removed_when_the_next_one_starts(
    service: SandboxService,
) -> None:
    sid = (await service.new_session(OWNER)).session_id
    try:
        left = "import os; os.makedirs('.mcpx-uploads'); open('.mcpx-uploads/' + 'a' * 32, 'wb').write(b'x' * 99)"
        assert (await service.run(OWNER, left + "; open('kept.txt', 'w').write('k')", session_id=sid)).status == "ok"
        session = service.sessions.get(sid, OWNER)
        assert session.sandbox is not None
        await session.sandbox.destroy()  # as if it died mid-upload
        after = await service.run(
            OWNER, "import os; print(sorted(set(os.listdir('/mnt/data')) - {'.mcpx'}))", session_id=sid
        )
        assert after.session_restarted and after.stdout == "['kept.txt']\n", after
    finally:
        await service.close_session(OWNER, sid)
