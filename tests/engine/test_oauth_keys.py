"""The resource server's fetches from its authorization server, against hostile endpoints and a real
provider rotating its keys.

A metadata or JWKS endpoint that is slow, trickles, is huge, is a compressed bomb, nests deeply,
redirects or fails is given up within its bound, and the keys already held are kept; metadata that
names another issuer is refused; an unknown ``kid`` fetches the keys again at most once per
``MIN_REFRESH_S``; a token whose key is known never waits for a fetch another request is doing. The
real provider (oidc-provider) restarted on its address with a new signing key first is followed
after one fetch, and its old key keeps working while it is still published.
"""

from __future__ import annotations

import gzip
import time
from collections.abc import AsyncIterator, Callable
from typing import Any

import anyio
import jwt
import pytest
from _oauth import SCOPES, provider_config, rsa_jwk, running_provider, skip_without_provider
from _oauth_browser import serving
from _support import free_port
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, RedirectResponse, Response, StreamingResponse
from starlette.routing import Route

from mcp_code_exec.config.oauth import OAuthSettings
from mcp_code_exec.mcp_server.http import oauth_keys
from mcp_code_exec.mcp_server.http.oauth_keys import MAX_KEYS, Fetcher
from mcp_code_exec.mcp_server.http.oauth_verifier import OAuthVerifier

pytestmark = pytest.mark.anyio
KEY = rsa_jwk("good")
PUBLIC = {name: KEY[name] for name in ("kty", "n", "e", "kid", "use", "alg")}
BOMB = gzip.compress(b'{"keys": [], "pad": "' + b"0" * (64 << 20) + b'"}', 9)  # 64 MiB in about 64 KiB


class Hostile:
    """One listener serving, per case, metadata whose ``jwks_uri`` is that case's endpoint."""

    def __init__(self) -> None:
        self.port = free_port()
        self.base = f"http://127.0.0.1:{self.port}"
        self.release = anyio.Event()  # ends the "held" endpoint's wait
        self.held_now = anyio.Event()  # a request is waiting there
        cases: dict[str, Callable[[Request], Any]] = {
            "good": self.good,
            "slow": self.slow,
            "held": self.held,
            "trickle": self.trickle,
            "huge": self.huge,
            "bomb": self.bomb,
            "deep": self.deep,
            "redirect": self.redirect,
            "failing": self.failing,
            "many": self.many,
        }
        self.jwks: dict[str, Callable[[Request], Any]] = dict(cases)
        routes = [Route("/.well-known/oauth-authorization-server/{case}", self.metadata)]
        routes += [Route("/jwks/{case}", self.keys)]
        self.app = Starlette(routes=routes)

    def issuer(self, case: str) -> str:
        return f"{self.base}/{case}"

    async def metadata(self, request: Request) -> JSONResponse:
        case = request.path_params["case"]
        issuer = "http://evil.invalid" if case == "other-issuer" else self.issuer(case)
        return JSONResponse({"issuer": issuer, "jwks_uri": f"{self.base}/jwks/{case}"})

    async def keys(self, request: Request) -> Any:
        return await self.jwks.get(request.path_params["case"], self.good)(request)

    async def good(self, request: Request) -> JSONResponse:
        return JSONResponse({"keys": [PUBLIC]})

    async def slow(self, request: Request) -> JSONResponse:
        await anyio.sleep(120)
        return JSONResponse({"keys": [PUBLIC]})

    async def held(self, request: Request) -> JSONResponse:
        self.held_now.set()
        await self.release.wait()
        return JSONResponse({"keys": [PUBLIC]})

    async def trickle(self, request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b'{"keys": ['
            for _ in range(1200):
                await anyio.sleep(0.1)
                yield b" "

        return StreamingResponse(body(), media_type="application/json")

    async def huge(self, request: Request) -> StreamingResponse:
        async def body() -> AsyncIterator[bytes]:
            yield b'{"keys": [], "pad": "'
            for _ in range(50 * 1024):
                yield b"x" * 1024
            yield b'"}'

        return StreamingResponse(body(), media_type="application/json")

    async def bomb(self, request: Request) -> Response:
        return Response(BOMB, media_type="application/json", headers={"content-encoding": "gzip"})

    async def deep(self, request: Request) -> Response:
        return Response(b'{"keys": ' + b"[" * 50_000 + b"]" * 50_000 + b"}", media_type="application/json")

    async def redirect(self, request: Request) -> RedirectResponse:
        return RedirectResponse(f"{self.base}/jwks/good", status_code=302)

    async def failing(self, request: Request) -> Response:
        return Response("no", status_code=500)

    async def many(self, request: Request) -> JSONResponse:
        return JSONResponse({"keys": [{**PUBLIC, "kid": f"k{i}"} for i in range(300)] + [PUBLIC]})


def signed(issuer: str, kid: str = "good") -> str:
    now = int(time.time())
    claims = {"iss": issuer, "aud": "http://127.0.0.1:1/mcp", "sub": "alice", "iat": now, "exp": now + 300}
    return jwt.encode({**claims, "scope": "mcp:tools"}, jwt.PyJWK(KEY).key, algorithm="RS256", headers={"kid": kid})


def verifier(issuer: str, timeout_s: float = 1.0) -> OAuthVerifier:
    settings = OAuthSettings(issuer=issuer, resource="http://127.0.0.1:1/mcp")
    return OAuthVerifier(settings, Fetcher(timeout_s=timeout_s))


@pytest.fixture(scope="module")
async def hostile() -> AsyncIterator[Hostile]:
    made = Hostile()
    async with serving(made.app, made.port):
        yield made
    made.release.set()


@pytest.mark.parametrize(
    ("case", "reason"),
    [
        ("slow", "ReadTimeout"),
        ("trickle", "did not answer in time"),
        ("huge", "more than 262144 bytes"),
        ("bomb", "more than 262144 bytes"),
        ("deep", "nested deeper"),
        ("redirect", "HTTP 302"),
        ("failing", "HTTP 500"),
        ("many", "no key 'good'"),
        ("other-issuer", "names issuer 'http://evil.invalid'"),
    ],
)
async def test_a_hostile_key_or_metadata_endpoint_is_given_up_within_its_bound(
    hostile: Hostile, case: str, reason: str
) -> None:
    checker = verifier(hostile.issuer(case))
    with anyio.fail_after(15):  # each fetch: 1 s to connect or read, 2 s in all; the slow one sleeps 120 s
        assert await checker.verify_token(signed(hostile.issuer(case))) is None
    assert reason in (checker.last_refusal or ""), checker.last_refusal
    if case == "many":
        assert len(checker.keys.held.keys) == MAX_KEYS
    await checker.aclose()


async def test_the_keys_held_survive_a_failing_fetch_and_an_unknown_kid_fetches_at_most_once_a_while(
    hostile: Hostile, monkeypatch: pytest.MonkeyPatch
) -> None:
    checker = verifier(hostile.issuer("swap"))
    hostile.jwks["swap"] = hostile.good
    assert await checker.verify_token(signed(hostile.issuer("swap"))) is not None, checker.last_refusal
    hostile.jwks["swap"] = hostile.failing
    monkeypatch.setattr(oauth_keys, "MIN_REFRESH_S", 0.0)
    assert await checker.verify_token(signed(hostile.issuer("swap"), kid="rotated")) is None
    assert "no key 'rotated'" in (checker.last_refusal or "")
    assert await checker.verify_token(signed(hostile.issuer("swap"))) is not None  # cached, and still known
    monkeypatch.setattr(oauth_keys, "MIN_REFRESH_S", 3600.0)
    fetched = len(checker.fetcher.fetched)
    for n in range(5):
        assert await checker.verify_token(signed(hostile.issuer("swap"), kid=f"unknown-{n}")) is None
    assert len(checker.fetcher.fetched) == fetched  # the last attempt is younger than MIN_REFRESH_S
    await checker.aclose()


async def test_a_token_whose_key_is_known_never_waits_for_a_fetch_another_request_is_doing(
    hostile: Hostile, monkeypatch: pytest.MonkeyPatch
) -> None:
    checker = verifier(hostile.issuer("stale"), timeout_s=120)  # the held fetch lasts until released
    hostile.jwks["stale"] = hostile.good
    assert await checker.verify_token(signed(hostile.issuer("stale"))) is not None
    hostile.jwks["stale"] = hostile.held  # answers only when released
    monkeypatch.setattr(oauth_keys, "MAX_AGE_S", 0.0)  # the keys held are stale: the next check fetches
    monkeypatch.setattr(oauth_keys, "MIN_REFRESH_S", 0.0)
    checker.results.items.clear()
    async with anyio.create_task_group() as tasks:

        async def refreshing() -> None:
            assert await checker.verify_token(signed(hostile.issuer("stale"))) is not None

        tasks.start_soon(refreshing)
        with anyio.fail_after(60):
            await hostile.held_now.wait()
        assert checker.keys.lock.locked()  # the first check is fetching, and held there
        checker.results.items.clear()
        with anyio.fail_after(30):  # far less than the held fetch, which never ends by itself
            assert await checker.verify_token(signed(hostile.issuer("stale"))) is not None
        assert checker.keys.lock.locked()  # ...and still is: the second did not wait for it
        hostile.release.set()


@skip_without_provider()
async def test_a_rotated_signing_key_is_followed_after_one_fetch_and_the_old_one_still_works() -> None:
    old, new = rsa_jwk("key-1"), rsa_jwk("key-2")
    resource = f"http://127.0.0.1:{free_port()}/mcp"
    resources = {resource: {"scope": SCOPES, "format": "jwt"}}
    async with running_provider(provider_config(resources, [old], ["machine-1"])) as first:
        checker = OAuthVerifier(OAuthSettings(issuer=first.issuer, resource=resource))
        before = await first.token(resource)
        assert await checker.verify_token(before) is not None, checker.last_refusal
        port = first.port
    rotated = {**provider_config(resources, [new, old], ["machine-1"]), "port": port}
    async with running_provider(rotated) as second:
        assert second.issuer == first.issuer
        checker.keys.attempted = float("-inf")  # as if MIN_REFRESH_S had passed since the first fetch
        after = await second.token(resource)
        assert jwt.get_unverified_header(after)["kid"] == "key-2"
        assert await checker.verify_token(after) is not None, checker.last_refusal
        assert set(checker.keys.held.keys) == {"key-1", "key-2"}
        checker.results.items.clear()
        assert await checker.verify_token(before) is not None, checker.last_refusal
    await checker.aclose()
