"""File URLs without Docker: the token table's rules (a fake clock), and /files/{token} served by the
real Starlette app over the in-memory engine (httpx2's ASGI transport, no sockets)."""

from __future__ import annotations

from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from typing import Any

import httpx2
import pytest
from _fake_agent import FakeAgent
from mcp import Client
from test_service_in_memory import running, settings

from mcp_code_exec.config.settings import Config
from mcp_code_exec.errors import (
    FileOperationError,
    PoolBusy,
    QuotaExceeded,
    SandboxError,
    SandboxLost,
    SessionBusy,
    SessionNotFound,
    TooLarge,
)
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.mcp_server.http.auth import Authenticator
from mcp_code_exec.mcp_server.http.file_routes import FileLinks, status_of
from mcp_code_exec.mcp_server.http.file_tokens import (
    ExpiredToken,
    FileTokens,
    InUse,
    SpentToken,
    UnknownToken,
    WrongDirection,
)
from mcp_code_exec.mcp_server.http.host import ServeOptions, file_links, http_server
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
MIB = 1 << 20


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_download_token_works_until_it_expires_then_is_refused_then_forgotten() -> None:
    clock = Clock()
    tokens = FileTokens(60, clock=clock)
    token = tokens.issue("alice", "s1", "a.csv", "download")
    for _ in range(3):
        grant = tokens.redeem(token, "download")
        assert (grant.identity, grant.session_id, grant.path) == ("alice", "s1", "a.csv")
    clock.now += 60
    with pytest.raises(ExpiredToken) as expired:
        tokens.redeem(token, "download")
    assert expired.value.status == 403
    clock.now += 60
    with pytest.raises(UnknownToken) as unknown:
        tokens.redeem(token, "download")
    assert unknown.value.status == 404 and len(tokens) == 0


def test_an_upload_token_works_once() -> None:
    tokens = FileTokens(60, clock=Clock())
    token = tokens.issue("alice", "s1", "in.bin", "upload")
    assert tokens.redeem(token, "upload").direction == "upload"
    with pytest.raises(SpentToken):
        tokens.redeem(token, "upload")


def test_the_wrong_method_is_refused_without_spending_the_token() -> None:
    tokens = FileTokens(60, clock=Clock())
    upload = tokens.issue("alice", "s1", "in.bin", "upload")
    with pytest.raises(WrongDirection) as wrong:
        tokens.redeem(upload, "download")
    assert wrong.value.status == 405
    assert tokens.redeem(upload, "upload").path == "in.bin"


def test_a_url_serves_one_request_at_a_time_and_names_its_issuer() -> None:
    tokens = FileTokens(60, clock=Clock())
    token = tokens.issue("token:alice", "s1", "a.csv", "download")
    assert tokens.claim(token, "download").path == "a.csv"
    with pytest.raises(InUse) as busy:
        tokens.claim(token, "download")
    assert busy.value.status == 409 and "in use by another transfer" in busy.value.message
    assert tokens.issuer(token) == "token:alice" and tokens.issuer("x" * 43) is None
    tokens.release(token)
    assert tokens.claim(token, "download").identity == "token:alice"


def test_made_up_and_malformed_tokens_are_unknown() -> None:
    tokens = FileTokens(60, clock=Clock())
    real = tokens.issue("alice", "s1", "a", "download")
    for fake in ("x" * 43, real[:-1], real + "A", "", "../../etc/passwd"):
        with pytest.raises(UnknownToken):
            tokens.redeem(fake, "download")


def test_tokens_are_random_and_only_their_hashes_are_kept() -> None:
    tokens = FileTokens(60, clock=Clock())
    issued = {tokens.issue("alice", "s1", "a", "download") for _ in range(50)}
    assert len(issued) == 50 and all(len(t) == 43 for t in issued)
    assert not any(t.encode() in key or t in repr(key) for t in issued for key in tokens._entries)


def test_each_identity_holds_a_bounded_number_of_tokens_and_loses_its_oldest_first() -> None:
    tokens = FileTokens(60, max_per_identity=3, clock=Clock())
    theirs = tokens.issue("bob", "s2", "b", "download")
    mine = [tokens.issue("alice", "s1", f"f{n}", "download") for n in range(5)]
    with pytest.raises(UnknownToken):
        tokens.redeem(mine[0], "download")
    assert [tokens.redeem(t, "download").path for t in mine[2:]] == ["f2", "f3", "f4"]
    assert tokens.redeem(theirs, "download").identity == "bob"


# -- the route ------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("error", "download", "upload"),
    [
        (TimeoutError(), 408, 408),
        (SessionNotFound("s_1"), 404, 404),
        (SessionBusy("s_1", None), 409, 409),
        (QuotaExceeded("over"), 507, 507),
        (TooLarge("big"), 413, 413),
        (FileOperationError("refused"), 404, 409),
        (SandboxLost("gone"), 503, 503),
        (PoolBusy("wait"), 503, 503),
    ],
)
def test_a_failed_transfer_answers_with_the_status_its_error_names(
    error: SandboxError | TimeoutError, download: int, upload: int
) -> None:
    assert (status_of(error, "download"), status_of(error, "upload")) == (download, upload)


TOKEN = "bearer-of-the-mcp-endpoint"


def links_for(config: Config) -> FileLinks:
    return file_links(
        config.files, config.limits, config.http, ServeOptions(transport="streamable-http", host="127.0.0.1", port=8000)
    )


@asynccontextmanager
async def served(
    agent: FakeAgent, **sections: dict[str, Any]
) -> AsyncIterator[tuple[SandboxService, FileLinks, httpx2.AsyncClient]]:
    config = settings(**sections)
    links = links_for(config)
    async with running(agent, config) as (service, _):
        server = http_server(service, Authenticator({"default": TOKEN}), links)
        app = server.streamable_http_app(transport_security=links.security, host="127.0.0.1")
        transport = httpx2.ASGITransport(app=app)
        async with httpx2.AsyncClient(transport=transport, base_url="http://127.0.0.1:8000") as http:
            yield service, links, http


async def test_a_file_goes_in_with_put_and_out_with_get_without_the_bearer_token() -> None:
    agent = FakeAgent()
    async with served(agent) as (service, links, http):
        sid = (await service.new_session("token:default")).session_id
        assert (await http.post("/mcp", json={})).status_code == 401  # the MCP endpoint does want it
        data = bytes(range(256)) * 9000
        up = links.tokens.issue("token:default", sid, "dir/é x.bin", "upload")
        put = await http.put(f"/files/{up}", content=data)
        assert put.status_code == 201, put.text
        assert put.json()["size"] == len(data) and agent.files["dir/é x.bin"] == data
        down = links.tokens.issue("token:default", sid, "dir/é x.bin", "download")
        got = await http.get(f"/files/{down}")
        assert got.status_code == 200 and got.content == data
        assert got.headers["content-length"] == str(len(data))
        assert got.headers["content-type"] == "application/octet-stream"
        assert got.headers["content-disposition"] == "attachment; filename=\"_ x.bin\"; filename*=UTF-8''%C3%A9%20x.bin"
        assert got.headers["cache-control"] == "no-store" and got.headers["referrer-policy"] == "no-referrer"
        posted = links.tokens.issue("token:default", sid, "posted.txt", "upload")
        assert (await http.post(f"/files/{posted}", content=b"by post")).status_code == 201
        assert agent.files["posted.txt"] == b"by post"
        await service.close_session("token:default", sid)


async def test_tokens_that_do_not_allow_the_request_are_refused_with_their_status() -> None:
    async with served(FakeAgent()) as (service, links, http):
        sid = (await service.new_session("me")).session_id
        up = links.tokens.issue("me", sid, "once.txt", "upload")
        assert (await http.get(f"/files/{up}")).status_code == 405
        assert (await http.put(f"/files/{up}", content=b"1")).status_code == 201
        again = await http.put(f"/files/{up}", content=b"2")
        assert again.status_code == 403 and "used already" in again.text
        assert (await http.get("/files/" + "A" * 43)).status_code == 404
        down = links.tokens.issue("me", sid, "once.txt", "download")
        wrong = await http.put(f"/files/{down}", content=b"x")
        assert wrong.status_code == 405 and wrong.headers["allow"] == "GET"
        missing = links.tokens.issue("me", sid, "nothing-here.txt", "download")
        assert (await http.get(f"/files/{missing}")).status_code == 404
        await service.close_session("me", sid)
        closed = await http.get(f"/files/{down}")
        assert closed.status_code == 404 and "no such session" in closed.text


async def test_the_host_and_origin_checks_of_the_mcp_endpoint_apply_to_file_urls() -> None:
    async with served(FakeAgent()) as (service, links, http):
        sid = (await service.new_session("me")).session_id
        down = links.tokens.issue("me", sid, "x", "download")
        assert (await http.get(f"/files/{down}", headers={"Host": "evil.example"})).status_code == 421
        assert (await http.get(f"/files/{down}", headers={"Origin": "https://evil.example"})).status_code == 403
        await service.close_session("me", sid)


async def test_uploads_over_the_cap_or_the_quota_are_refused_and_leave_nothing() -> None:
    agent = FakeAgent(quota=2 * MIB)
    async with served(agent, files={"max_upload_mb": 4}) as (service, links, http):
        sid = (await service.new_session("me")).session_id
        big = links.tokens.issue("me", sid, "big.bin", "upload")
        refused = await http.put(f"/files/{big}", content=b"x" * (5 * MIB))
        assert refused.status_code == 413 and "upload cap" in refused.text
        over = links.tokens.issue("me", sid, "over.bin", "upload")
        quota = await http.put(f"/files/{over}", content=b"x" * (3 * MIB))
        assert quota.status_code == 507 and "nothing was written" in quota.text
        assert agent.files == {} and agent.staging == {}
        await service.close_session("me", sid)


async def test_file_url_over_stdio_says_that_urls_need_http() -> None:
    async with running(FakeAgent(), settings()) as (service, _), Client(build_server(service)) as client:
        sid = (await client.call_tool("new_session", {})).structured_content or {}
        answer = await client.call_tool(
            "file_url", {"session_id": sid["session_id"], "path": "a", "direction": "upload"}
        )
        assert answer.is_error and "need the HTTP transport" in str(answer.content[0])


async def test_file_url_hands_out_a_url_for_the_callers_own_session_only() -> None:
    agent = FakeAgent(files={"report.csv": b"a,b\n1,2\n"})
    config = settings(files={"public_base_url": "https://sandbox.example.com/base/"})
    links = links_for(config)
    async with running(agent, config) as (service, _), Client(build_server(service, file_urls=links)) as client:
        sid = ((await client.call_tool("new_session", {})).structured_content or {})["session_id"]
        down = await client.call_tool("file_url", {"session_id": sid, "path": "report.csv", "direction": "download"})
        got = down.structured_content or {}
        assert not down.is_error and got["url"].startswith("https://sandbox.example.com/base/files/")
        assert got["size"] == 8 and got["method"] == "GET" and not got["single_use"]
        assert links.tokens.redeem(got["url"].rsplit("/", 1)[1], "download").session_id == sid
        up = await client.call_tool("file_url", {"session_id": sid, "path": "in.bin", "direction": "upload"})
        assert (up.structured_content or {})["single_use"] and "curl -fT in.bin" in (up.structured_content or {})[
            "example"
        ]
        other = await service.new_session("someone else")
        refused = await client.call_tool(
            "file_url", {"session_id": other.session_id, "path": "x", "direction": "upload"}
        )
        assert refused.is_error and "no such session" in str(refused.content[0])
        missing = await client.call_tool("file_url", {"session_id": sid, "path": "nope", "direction": "download"})
        assert missing.is_error and "no such file" in str(missing.content[0])
        await service.close_session("someone else", other.session_id)
