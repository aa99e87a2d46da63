"""A real authorization server for the OAuth tests: oidc-provider 9.13.3 on loopback.

``fixtures/oauth/provider.mjs`` (pinned by its lockfile, installed by ``.ci/run`` with ``npm ci``)
runs with a JSON configuration written here: its signing keys (made per run, so nothing secret is
committed), the resources it issues tokens for (RFC 8707, each with its scopes and format), its
static clients, and optionally another issuer's name or a shifted clock. It prints one ready line
and stops when its stdin closes. Tokens come from it, never from this side, except where a test says
it forges one with the provider's own key.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import anyio
import httpx2
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from jwt.algorithms import RSAAlgorithm

FIXTURE = Path(__file__).resolve().parent / "fixtures" / "oauth"
PROVIDER = FIXTURE / "provider.mjs"
SCOPES = "mcp:tools mcp:metrics"


def provider_missing() -> str | None:
    """Why the provider cannot run here (None: it can)."""
    if shutil.which("node") is None:
        return "needs node"
    if not (FIXTURE / "node_modules" / "oidc-provider").is_dir():
        return "needs oidc-provider: npm ci --prefix tests/engine/fixtures/oauth"
    return None


def skip_without_provider() -> pytest.MarkDecorator:
    missing = provider_missing()
    return pytest.mark.skipif(missing is not None, reason=missing or "")


def rsa_jwk(kid: str) -> dict[str, Any]:
    """A private RSA signing key as a JWK (the provider signs with it; a test may forge with it)."""
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk: dict[str, Any] = json.loads(RSAAlgorithm.to_jwk(key))
    jwk.update(kid=kid, use="sig", alg="RS256")
    return jwk


def machine(name: str) -> dict[str, Any]:
    """A static client that gets tokens with client credentials (its secret is ``<name>-secret``)."""
    return {
        "client_id": name,
        "client_secret": f"{name}-secret",
        "grant_types": ["client_credentials"],
        "redirect_uris": [],
        "response_types": [],
    }


@dataclass
class Provider:
    issuer: str
    port: int
    config: dict[str, Any]
    log: Path
    machines: list[str] = field(default_factory=list)

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    async def token(self, resource: str, scope: str = "mcp:tools", client: str = "machine-1") -> str:
        """An access token for ``resource`` by the client-credentials grant."""
        async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
            answer = await http.post(
                f"{self.url}/token",
                data={"grant_type": "client_credentials", "resource": resource, "scope": scope},
                auth=(client, f"{client}-secret"),
            )
        assert answer.status_code == 200, answer.text
        return str(answer.json()["access_token"])

    def requests(self, method: str, path: str) -> int:
        """How many requests for ``path`` reached the provider so far (from its log)."""
        return self.log.read_text(errors="replace").count(f"request {method} {path}\n")

    async def revoke(self, token: str, client: str = "machine-1") -> None:
        async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
            answer = await http.post(
                f"{self.url}/token/revocation", data={"token": token}, auth=(client, f"{client}-secret")
            )
        assert answer.status_code == 200, answer.text


def provider_config(
    resources: dict[str, dict[str, Any]], keys: list[dict[str, Any]], clients: list[str], **more: Any
) -> dict[str, Any]:
    return {"port": 0, "jwks": {"keys": keys}, "resources": resources, "clients": [machine(c) for c in clients], **more}


@asynccontextmanager
async def running_provider(config: dict[str, Any], env: dict[str, str] | None = None) -> AsyncIterator[Provider]:
    """``provider.mjs`` with ``config`` until the block ends (its ready line waited for, bounded)."""
    with tempfile.TemporaryDirectory(prefix="oidc-provider-") as directory:
        path, log = Path(directory) / "config.json", Path(directory) / "provider.log"
        path.write_text(json.dumps(config))
        with log.open("wb") as errors:
            process = subprocess.Popen(
                ["node", str(PROVIDER), str(path)],
                cwd=FIXTURE,
                stdin=subprocess.PIPE,
                stdout=subprocess.PIPE,
                stderr=errors,
                env={**os.environ, "NODE_NO_WARNINGS": "1", **(env or {})},
            )
            try:
                assert process.stdout is not None
                with anyio.fail_after(30):
                    line = await anyio.to_thread.run_sync(process.stdout.readline)
                if not line:
                    raise RuntimeError(f"the provider did not start: {log.read_text()[-2000:]}")
                ready = json.loads(line)
                clients = [c["client_id"] for c in config.get("clients", [])]
                yield Provider(ready["issuer"], ready["port"], config, log, clients)
            finally:
                await stop(process)


async def stop(process: subprocess.Popen[bytes]) -> None:
    if process.stdin is not None:
        process.stdin.close()  # the provider's cue to stop
    process.terminate()
    try:
        await anyio.to_thread.run_sync(lambda: process.wait(10))
    except subprocess.TimeoutExpired:
        process.kill()
        process.wait()
    if process.stdout is not None:
        process.stdout.close()


def server_config(oauth: dict[str, Any], *, durable: bool = False, more: str = "") -> str:
    """A server's configuration: the test image, one warm container, ``[http.oauth]`` as given."""
    from _support import make_test_config

    lines = [f"{key} = {json.dumps(value)}" for key, value in oauth.items()]
    return "\n".join(
        [
            f"image = {json.dumps(make_test_config().image)}",
            '[limits]\nmemory_mb = 256\nsession_disk = "agent"\nsession_data_mb = 64',
            "[pool]\nsize = 1\nsession_spares = 0",
            f"[sessions]\ndurable = {'true' if durable else 'false'}",
            more,
            "[http.oauth]",
            *lines,
            "",
        ]
    )
