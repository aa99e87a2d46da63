"""The resource server's bookkeeping of what it asks its provider, answered in memory: which
introspection bucket (RFC 7662) a call is taken from, what the fetcher keeps of its calls, and
metadata that moves the keys under a running server.

The same against a real authorization server is in ``tests/engine/test_oauth_refusals.py``.
"""

from __future__ import annotations

import time
from typing import Any

import httpx2
import jwt
import pytest
from test_oauth_checks import claims, private_jwk

from mcp_code_exec.config.oauth import OAuthSettings
from mcp_code_exec.mcp_server.http import oauth_keys
from mcp_code_exec.mcp_server.http.oauth_keys import Fetcher
from mcp_code_exec.mcp_server.http.oauth_verifier import OAuthVerifier

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


def public(key: dict[str, Any]) -> dict[str, Any]:
    return {name: key[name] for name in ("kty", "n", "e", "kid", "use", "alg")}


def signed(key: dict[str, Any]) -> str:
    return jwt.encode(claims(), jwt.PyJWK(key).key, algorithm="RS256", headers={"kid": key["kid"], "typ": "at+jwt"})


def introspecting(**settings: Any) -> OAuthVerifier:
    fetcher = Fetcher(httpx2.AsyncClient(transport=httpx2.MockTransport(provider)))
    secret = {"introspection_client_id": "mcp", "introspection_client_secret": "s"}
    return OAuthVerifier(OAuthSettings(issuer=ISSUER, resource=RESOURCE, **secret, **settings), fetcher=fetcher)


@pytest.mark.anyio
async def test_made_up_tokens_emptying_the_bucket_leave_a_signed_in_token_its_own() -> None:
    async def scenario() -> None:
        made = introspecting(introspection_cache_s=0, introspections_per_s=1)  # asked every time; a burst of 2
        assert await made.verify_token(GOOD) is not None, made.last_refusal
        refused = [await made.verify_token(f"made-up-{n}") for n in range(10)]
        assert refused == [None] * 10 and "introspections_per_s" in (made.last_refusal or "")
        assert await made.verify_token(GOOD) is not None, made.last_refusal  # asked again, from its own bucket
        await made.aclose()

    await scenario()


@pytest.mark.anyio
async def test_the_fetcher_keeps_nothing_per_call() -> None:
    async def scenario() -> None:
        made = introspecting(introspection_cache_s=0, introspections_per_s=10_000)
        for _ in range(2000):
            assert await made.verify_token(GOOD) is not None
        grown = {name: len(value) for name, value in vars(made.fetcher).items() if isinstance(value, list | dict)}
        assert all(size < 10 for size in grown.values()), grown
        assert made.fetcher.fetches == 2001  # the metadata once, then each introspection
        await made.aclose()

    await scenario()


@pytest.mark.anyio
async def test_a_provider_that_moves_its_keys_is_followed_once_its_metadata_is_old() -> None:
    """The metadata names another jwks_uri (the old one now fails): after ``MAX_AGE_S`` the server
    reads the metadata again and the keys from there; before that, it keeps what it holds."""
    old, new = private_jwk("old"), private_jwk("new")
    moved = [False]

    def moving(request: httpx2.Request) -> httpx2.Response:
        jwks = f"{ISSUER}jwks/{'b' if moved[0] else 'a'}"
        if request.url.path.startswith("/.well-known/"):
            return httpx2.Response(200, json={"issuer": ISSUER, "jwks_uri": jwks})
        if str(request.url) != jwks:
            return httpx2.Response(404)
        return httpx2.Response(200, json={"keys": [public(new if moved[0] else old)]})

    async def scenario() -> None:
        now = [1000.0]
        fetcher = Fetcher(httpx2.AsyncClient(transport=httpx2.MockTransport(moving)))
        made = OAuthVerifier(OAuthSettings(issuer=ISSUER, resource=RESOURCE), fetcher=fetcher)
        made.metadata.clock = made.keys.clock = lambda: now[0]
        assert await made.verify_token(signed(old)) is not None, made.last_refusal
        moved[0] = True
        now[0] += oauth_keys.MAX_AGE_S
        assert await made.verify_token(signed(new)) is not None, made.last_refusal
        await made.aclose()

    await scenario()


@pytest.mark.anyio
async def test_keys_or_introspection_the_metadata_names_over_plain_http_are_not_used() -> None:
    """An https issuer whose metadata names http endpoints (a provider behind a proxy that lost the
    scheme): keys read in clear could be swapped, and the introspection secret would be read."""
    asked: list[str] = []
    key = private_jwk("k1")

    def in_clear(request: httpx2.Request) -> httpx2.Response:
        asked.append(str(request.url))
        if request.url.path.startswith("/.well-known/"):
            endpoints = {
                "jwks_uri": "http://auth.example.com/jwks",
                "introspection_endpoint": "http://auth.example.com/i",
            }
            return httpx2.Response(200, json={"issuer": ISSUER, **endpoints})
        return httpx2.Response(200, json={"keys": [public(key)], "active": True})

    async def scenario() -> None:
        secret = {"introspection_client_id": "mcp", "introspection_client_secret": "s"}
        fetcher = Fetcher(httpx2.AsyncClient(transport=httpx2.MockTransport(in_clear)))
        made = OAuthVerifier(OAuthSettings(issuer=ISSUER, resource=RESOURCE, **secret), fetcher=fetcher)
        assert await made.verify_token(signed(key)) is None
        assert "not https" in (made.last_refusal or ""), made.last_refusal
        assert await made.verify_token("opaque-token") is None
        assert "not https" in (made.last_refusal or ""), made.last_refusal
        assert not [url for url in asked if url.startswith("http://")], asked
        await made.aclose()

    await scenario()
