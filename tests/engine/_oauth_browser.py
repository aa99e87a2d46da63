"""The client's side of an authorization-code flow, for the MCP SDK's own OAuth client in the tests.

- ``LoopbackCallback``: the redirect URI, a listener on loopback that hands the code over;
- ``BrowserConsent``: the SDK's ``redirect_handler``: Debian's chromium, headless under Playwright
  (the dev extra's; never its own browser download), opens the authorization URL, signs in on the
  provider's login page as a given subject and consents;
- ``MemoryStorage``: tokens and the registered client, in memory;
- ``loopback_tls``: a throwaway CA and a certificate for 127.0.0.1, for the client ID metadata
  document (an https URL the provider fetches);
- ``serving``: a Starlette app under uvicorn in this event loop, until the block ends.
"""

from __future__ import annotations

import datetime
import ipaddress
import shutil
import socket
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from pathlib import Path
from typing import Any

import anyio
import pytest
import uvicorn
from cryptography import x509
from cryptography.hazmat.primitives import hashes, serialization
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.x509.oid import NameOID
from mcp.client.auth import TokenStorage
from mcp.shared.auth import AuthorizationCodeResult, OAuthClientInformationFull, OAuthToken
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import PlainTextResponse
from starlette.routing import Route

CHROMIUM = shutil.which("chromium") or "/usr/bin/chromium"
CHROMIUM_FLAGS = ["--headless", "--no-sandbox", "--disable-gpu", "--disable-background-networking", "--no-first-run"]


def skip_without_chromium() -> pytest.MarkDecorator:
    return pytest.mark.skipif(shutil.which("chromium") is None, reason="needs chromium (Debian's)")


class MemoryStorage(TokenStorage):
    def __init__(self) -> None:
        self.tokens: OAuthToken | None = None
        self.client: OAuthClientInformationFull | None = None

    async def get_tokens(self) -> OAuthToken | None:
        return self.tokens

    async def set_tokens(self, tokens: OAuthToken) -> None:
        self.tokens = tokens

    async def get_client_info(self) -> OAuthClientInformationFull | None:
        return self.client

    async def set_client_info(self, client_info: OAuthClientInformationFull) -> None:
        self.client = client_info


class LoopbackCallback:
    """The client's redirect URI: hands the authorization response to ``wait`` (the SDK's callback)."""

    def __init__(self, port: int) -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{port}/callback"
        self.send, self.receive = anyio.create_memory_object_stream[AuthorizationCodeResult](1)
        self.app = Starlette(routes=[Route("/callback", self.callback)])

    async def callback(self, request: Request) -> PlainTextResponse:
        query = request.query_params
        if "code" not in query:
            return PlainTextResponse(f"authorization failed: {dict(query)}", status_code=400)
        await self.send.send(
            AuthorizationCodeResult(code=query["code"], state=query.get("state"), iss=query.get("iss"))
        )
        return PlainTextResponse("signed in; this window can close")

    async def wait(self) -> AuthorizationCodeResult:
        with anyio.fail_after(60):
            return await self.receive.receive()


class BrowserConsent:
    """Signs in as ``login`` on the provider's own login page and consents (its dev interactions)."""

    def __init__(self, login: str) -> None:
        self.login = login
        self.visited: list[str] = []

    async def __call__(self, authorization_url: str) -> None:
        from playwright.async_api import async_playwright

        self.visited.append(authorization_url)
        async with async_playwright() as playwright:
            browser = await playwright.chromium.launch(executable_path=CHROMIUM, args=CHROMIUM_FLAGS)
            try:
                page = await browser.new_page()
                page.set_default_timeout(30_000)
                await page.goto(authorization_url)
                await page.fill("input[name=login]", self.login)
                await page.fill("input[name=password]", "any-password")
                await page.click("button[type=submit]")
                await page.wait_for_selector("button[autofocus], button[type=submit]")
                self.visited.append(page.url)
                await page.click("button[type=submit]")  # the consent page's "Continue"
                await page.wait_for_url("**/callback?**")
                self.visited.append(page.url)
            finally:
                await browser.close()


def loopback_tls(directory: Path) -> tuple[Path, Path, Path]:
    """(ca.pem, cert.pem, key.pem): a CA made for this test and a certificate for 127.0.0.1 it signed."""
    now = datetime.datetime.now(datetime.UTC)
    since, until = now - datetime.timedelta(minutes=5), now + datetime.timedelta(hours=2)
    ca_key, key = ec.generate_private_key(ec.SECP256R1()), ec.generate_private_key(ec.SECP256R1())
    ca_name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "mcp-code-exec test CA")])
    ca = (
        x509.CertificateBuilder(subject_name=ca_name, issuer_name=ca_name, public_key=ca_key.public_key())
        .not_valid_before(since)
        .not_valid_after(until)
        .serial_number(x509.random_serial_number())
        .add_extension(x509.BasicConstraints(ca=True, path_length=0), critical=True)
        .sign(ca_key, hashes.SHA256())
    )
    host = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "127.0.0.1")])
    cert = (
        x509.CertificateBuilder(subject_name=host, issuer_name=ca_name, public_key=key.public_key())
        .not_valid_before(since)
        .not_valid_after(until)
        .serial_number(x509.random_serial_number())
        .add_extension(x509.SubjectAlternativeName([x509.IPAddress(ipaddress.ip_address("127.0.0.1"))]), critical=False)
        .sign(ca_key, hashes.SHA256())
    )
    paths = directory / "ca.pem", directory / "cert.pem", directory / "key.pem"
    paths[0].write_bytes(ca.public_bytes(serialization.Encoding.PEM))
    paths[1].write_bytes(cert.public_bytes(serialization.Encoding.PEM))
    private = key.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    paths[2].write_bytes(private)
    return paths


@asynccontextmanager
async def serving(app: Any, port: int, tls: tuple[Path, Path] | None = None) -> AsyncIterator[None]:
    """``app`` on 127.0.0.1:``port`` (https with ``tls`` = (cert, key)) while the block runs. The
    socket listens before the block starts: a request sent at once waits in its backlog."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", port))
    listener.listen(64)
    config = uvicorn.Config(
        app,
        log_level="warning",
        lifespan="off",
        timeout_graceful_shutdown=1,  # a request a test left hanging does not hold its end
        ssl_certfile=str(tls[0]) if tls else None,
        ssl_keyfile=str(tls[1]) if tls else None,
    )
    server = uvicorn.Server(config)
    try:
        async with anyio.create_task_group() as tasks:
            tasks.start_soon(server.serve, [listener])
            try:
                yield
            finally:
                server.should_exit = True
    finally:
        listener.close()
