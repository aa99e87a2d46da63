"""The resource server's bookkeeping of introspection (RFC 7662), with the provider answered in
memory: which bucket a call is taken from, and what the fetcher keeps of its calls.

The same against a real authorization server is in ``tests/engine/test_oauth_refusals.py``.
"""

from __future__ import annotations

import time
from typing import Any

import anyio
import httpx2

from mcp_code_exec.config.oauth import OAuthSettings
from mcp_code_exec.mcp_server.oauth_keys import Fetcher
from mcp_code_exec.mcp_server.oauth_verifier import OAuthVerifier

ISSUER = "https://auth.example.com/"
RESOURCE = "https://mcp.example.com/mcp"
GOOD = "signed-in-token"


def provider(request: httpx2.Request) -> httpx2.Response:
    """The issuer's metadata, and an introspection endpoint for which only ``GOOD`` is active."""
    if request.method == "GET":
        return httpx2.Response(200, json={"issuer": ISSUER, "introspection_endpoint": f"{ISSUER}introspect"})
    active = f"token={GOOD}".encode() in request.content
    answer: dict[str, Any] = {"active": active}
    if active:
        answer.update(sub="alice", aud=RESOURCE, scope="mcp:tools", exp=int(time.time()) + 600, iss=ISSUER)
    return httpx2.Response(200, json=answer)


def introspecting(**settings: Any) -> OAuthVerifier:
    fetcher = Fetcher(httpx2.AsyncClient(transport=httpx2.MockTransport(provider)))
    secret = {"introspection_client_id": "mcp", "introspection_client_secret": "s"}
    return OAuthVerifier(OAuthSettings(issuer=ISSUER, resource=RESOURCE, **secret, **settings), fetcher=fetcher)


def test_made_up_tokens_emptying_the_bucket_leave_a_signed_in_token_its_own() -> None:
    async def scenario() -> None:
        made = introspecting(introspection_cache_s=0, introspections_per_s=1)  # asked every time; a burst of 2
        assert await made.verify_token(GOOD) is not None, made.last_refusal
        refused = [await made.verify_token(f"made-up-{n}") for n in range(10)]
        assert refused == [None] * 10 and "introspections_per_s" in (made.last_refusal or "")
        assert await made.verify_token(GOOD) is not None, made.last_refusal  # asked again, from its own bucket
        await made.aclose()

    anyio.run(scenario)


def test_the_fetcher_keeps_nothing_per_call() -> None:
    async def scenario() -> None:
        made = introspecting(introspection_cache_s=0, introspections_per_s=10_000)
        for _ in range(2000):
            assert await made.verify_token(GOOD) is not None
        grown = {name: len(value) for name, value in vars(made.fetcher).items() if isinstance(value, list | dict)}
        assert all(size < 10 for size in grown.values()), grown
        assert made.fetcher.fetches == 2001  # the metadata once, then each introspection
        await made.aclose()

    anyio.run(scenario)
