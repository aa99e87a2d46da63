"""The MCP SDK's own OAuth client against the real server and a real authorization server
(docs/oauth.md; docs/security.md#oauth-access-tokens).

oidc-provider on loopback issues the tokens; the server (``serve`` with ``[http.oauth]``) checks them.
The SDK's client does the whole flow: discovery from the 401, registration (dynamic, or a client
ID metadata document served over https with a test CA), authorization code with PKCE, consent
given in Debian's chromium under Playwright, the token, then tool calls that run code in a
sandbox. Machine clients use client credentials, over streamable HTTP and SSE. Two subjects see
only their own sessions, and a durable session is served again after a restart to its subject only.
"""

from __future__ import annotations

import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any
from urllib.parse import parse_qs, urlsplit

import httpx2
import jwt
import pytest
from _durable import records_of, remove_sessions
from _oauth import SCOPES, Provider, provider_config, rsa_jwk, running_provider, server_config, skip_without_provider
from _oauth_browser import BrowserConsent, LoopbackCallback, MemoryStorage, loopback_tls, serving, skip_without_chromium
from _support import ServerProcess, free_port
from mcp import Client
from mcp.client.auth import OAuthClientProvider
from mcp.client.auth.extensions.client_credentials import ClientCredentialsOAuthProvider
from mcp.client.sse import sse_client
from mcp.client.streamable_http import streamable_http_client
from mcp.shared.auth import OAuthClientMetadata
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse
from starlette.routing import Route

pytestmark = [pytest.mark.anyio, skip_without_provider()]
CLIENTS = ["machine-1", "machine-2"]
SIX_BY_SEVEN = "import os\nprint('in', os.getcwd())\n6 * 7"


@dataclass
class Lab:
    idp: Provider
    server: ServerProcess
    sse: ServerProcess
    durable_port: int
    tls: tuple[Path, Path]  # the client metadata document's certificate and key

    @property
    def resource(self) -> str:
        return f"{self.server.url}/mcp"


@pytest.fixture(scope="module")
async def lab(service: Any) -> AsyncIterator[Lab]:
    server, sse, durable_port = ServerProcess("streamable-http"), ServerProcess("sse"), free_port()
    resources = {
        url: {"scope": SCOPES, "format": "jwt"}
        for url in (f"{server.url}/mcp", f"{sse.url}/sse", f"http://127.0.0.1:{durable_port}/mcp")
    }
    with tempfile.TemporaryDirectory() as directory:
        ca, cert, key = loopback_tls(Path(directory))
        config = provider_config(resources, [rsa_jwk("key-1")], CLIENTS, cimd=True)
        async with running_provider(config, env={"NODE_EXTRA_CA_CERTS": str(ca)}) as idp:
            for process, path in ((server, "/mcp"), (sse, "/sse")):
                file = Path(directory) / f"{process.port}.toml"
                file.write_text(server_config({"issuer": idp.issuer, "resource": f"{process.url}{path}"}))
                process.args = ["--config", str(file)]
            async with server, sse:
                yield Lab(idp, server, sse, durable_port, (cert, key))


def machine(lab: Lab, name: str, resource: str | None = None) -> ClientCredentialsOAuthProvider:
    return ClientCredentialsOAuthProvider(
        server_url=resource or lab.resource,
        storage=MemoryStorage(),
        client_id=name,
        client_secret=f"{name}-secret",
        scope="mcp:tools",
        issuer=lab.idp.issuer,
    )


@asynccontextmanager
async def connected(resource: str, auth: httpx2.Auth) -> AsyncIterator[Client]:
    http = httpx2.AsyncClient(auth=auth, timeout=60)
    async with http, Client(streamable_http_client(resource, http_client=http)) as client:
        yield client


async def call(client: Client, tool: str, **arguments: Any) -> tuple[bool, str, dict[str, Any]]:
    result = await client.call_tool(tool, arguments)
    text = str(getattr(result.content[0], "text", "")) if result.content else ""
    return bool(result.is_error), text, dict(result.structured_content or {})


def browser_client(callback: LoopbackCallback, consent: BrowserConsent, storage: MemoryStorage, **more: Any) -> Any:
    metadata = OAuthClientMetadata(
        client_name="mcp-code-exec engine test",
        redirect_uris=[callback.url],
        grant_types=["authorization_code", "refresh_token"],
        response_types=["code"],
        token_endpoint_auth_method="none",
    )
    return metadata, {"storage": storage, "redirect_handler": consent, "callback_handler": callback.wait, **more}


@skip_without_chromium()
async def test_the_sdks_client_registers_signs_in_in_a_browser_and_runs_code_in_a_sandbox(lab: Lab) -> None:
    callback, consent, storage = LoopbackCallback(free_port()), BrowserConsent("alice"), MemoryStorage()
    metadata, handlers = browser_client(callback, consent, storage)
    registrations = lab.idp.requests("POST", "/reg")
    oauth = OAuthClientProvider(server_url=lab.resource, client_metadata=metadata, **handlers)
    async with serving(callback.app, callback.port), connected(lab.resource, oauth) as client:
        error, said, result = await call(client, "run_python", code=SIX_BY_SEVEN)
    assert not error and result["result"] == "42" and "in /mnt/data" in result["stdout"], said
    assert lab.idp.requests("POST", "/reg") == registrations + 1  # dynamic client registration
    asked = {name: values[0] for name, values in parse_qs(urlsplit(consent.visited[0]).query).items()}
    assert asked["code_challenge_method"] == "S256" and asked["resource"] == lab.resource
    assert "mcp:tools" in asked["scope"].split()
    assert storage.tokens is not None
    claims = jwt.decode(storage.tokens.access_token, options={"verify_signature": False})
    assert (claims["sub"], claims["aud"], claims["iss"]) == ("alice", lab.resource, lab.idp.issuer)


@skip_without_chromium()
async def test_a_client_id_metadata_document_signs_in_without_registering(lab: Lab) -> None:
    callback, consent, storage = LoopbackCallback(free_port()), BrowserConsent("carol"), MemoryStorage()
    port = free_port()
    client_id = f"https://127.0.0.1:{port}/oauth/client.json"
    document = {
        "client_id": client_id,
        "client_name": "mcp-code-exec engine test (CIMD)",
        "redirect_uris": [callback.url],
        "grant_types": ["authorization_code", "refresh_token"],
        "response_types": ["code"],
        "token_endpoint_auth_method": "none",
        "application_type": "native",
    }
    fetched: list[str] = []

    async def client_document(request: Request) -> JSONResponse:
        fetched.append(request.url.path)
        return JSONResponse(document)

    documents = Starlette(routes=[Route("/oauth/client.json", client_document)])
    metadata, handlers = browser_client(callback, consent, storage, client_metadata_url=client_id)
    registrations = lab.idp.requests("POST", "/reg")
    oauth = OAuthClientProvider(server_url=lab.resource, client_metadata=metadata, **handlers)
    async with (
        serving(documents, port, tls=lab.tls),
        serving(callback.app, callback.port),
        connected(lab.resource, oauth) as client,
    ):
        error, said, result = await call(client, "run_python", code=SIX_BY_SEVEN)
    assert not error and result["result"] == "42", said
    assert storage.client is not None and storage.client.client_id == client_id and fetched
    assert lab.idp.requests("POST", "/reg") == registrations  # no registration: the document is the client


async def test_a_machine_client_with_client_credentials_runs_code_over_streamable_http_and_sse(lab: Lab) -> None:
    async with connected(lab.resource, machine(lab, "machine-1")) as client:
        error, said, result = await call(client, "run_python", code=SIX_BY_SEVEN)
    assert not error and result["result"] == "42", said
    resource = f"{lab.sse.url}/sse"
    async with Client(sse_client(resource, auth=machine(lab, "machine-1", resource))) as client:
        error, said, result = await call(client, "run_python", code="6 * 7")
    assert not error and result["result"] == "42", said
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
        metadata = (await http.get(f"{lab.sse.url}/.well-known/oauth-protected-resource/sse")).json()
    assert metadata["resource"] == resource and metadata["authorization_servers"] == [lab.idp.issuer]


async def test_two_subjects_see_only_their_own_sessions(lab: Lab) -> None:
    async with connected(lab.resource, machine(lab, "machine-1")) as first:
        error, said, made = await call(first, "new_session")
        assert not error, said
        sid = made["session_id"]
        try:
            await call(first, "run_python", code="secret = 'first'", session_id=sid)
            async with connected(lab.resource, machine(lab, "machine-2")) as second:
                tries = [("run_python", {"code": "secret", "session_id": sid}), ("list_files", {"session_id": sid})]
                for tool, arguments in tries:
                    error, said, _ = await call(second, tool, **arguments)
                    assert error and f"no such session: '{sid}'" in said, (tool, said)
                listed = [str(resource.uri) for resource in (await second.list_resources()).resources]
                assert not any(sid in uri for uri in listed), listed
            error, said, result = await call(first, "run_python", code="secret", session_id=sid)
            assert not error and result["result"] == "'first'", said
        finally:
            await call(first, "close_session", session_id=sid)


async def test_a_durable_session_is_served_again_after_a_restart_to_its_subject_only(lab: Lab, tmp_path: Path) -> None:
    resource = f"http://127.0.0.1:{lab.durable_port}/mcp"
    path = tmp_path / "durable.toml"
    path.write_text(server_config({"issuer": lab.idp.issuer, "resource": resource}, durable=True))
    sid = ""
    try:
        async with ServerProcess("streamable-http", args=["--config", str(path)], port=lab.durable_port) as first:
            async with connected(resource, machine(lab, "machine-1", resource)) as client:
                error, said, made = await call(client, "new_session")
                assert not error, said
                sid = made["session_id"]
                error, said, _ = await call(client, "run_python", code="kept = 41", session_id=sid)
                assert not error, said
            assert first.port == lab.durable_port
        assert records_of([sid]), "a stopped durable server keeps its sessions' records"
        async with ServerProcess("streamable-http", args=["--config", str(path)], port=lab.durable_port):
            async with connected(resource, machine(lab, "machine-2", resource)) as other:
                error, said, _ = await call(other, "run_python", code="kept", session_id=sid)
                assert error and f"no such session: '{sid}'" in said, said
            async with connected(resource, machine(lab, "machine-1", resource)) as client:
                error, said, result = await call(client, "run_python", code="kept + 1", session_id=sid)
                assert not error and result["result"] == "42", said
                assert any("resumed" in note for note in result["notes"]), result
                error, said, _ = await call(client, "close_session", session_id=sid)
                assert not error, said
        assert records_of([sid]) == {}
    finally:
        remove_sessions([sid] if sid else [])
