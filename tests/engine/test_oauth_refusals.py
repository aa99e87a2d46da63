"""The OAuth resource server refuses what it must, against a real authorization server
(docs/security.md#oauth-access-tokens).

The real server (``serve --transport streamable-http`` with ``[http.oauth]``) and oidc-provider on
loopback. Every token comes from the provider: a token for another resource of the same provider,
one of another issuer signed with the same key (a second provider), expired and not yet valid ones
(a provider with the same issuer and key whose clock runs behind or ahead), one signed with a key
the provider does not publish, one without the required scope, and an opaque token revoked at the
provider (a second server introspects). Only the forged signatures are made here, from a real
token. What reaches the provider is counted from its own log: made-up tokens never make the server
flood it, and routes that need no token never ask it.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import tempfile
import time
import uuid
from collections.abc import AsyncIterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import anyio
import httpx2
import jwt
import pytest
from _oauth import SCOPES, Provider, provider_config, rsa_jwk, running_provider, server_config, skip_without_provider
from _support import ServerProcess
from cryptography.hazmat.primitives.asymmetric import ec
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from jwt.algorithms import ECAlgorithm

pytestmark = [pytest.mark.anyio, skip_without_provider()]
KEY, STRANGER = rsa_jwk("key-1"), rsa_jwk("key-2")
CLIENTS = ["machine-1", "machine-2", "mcp-server"]
INITIALIZE = {
    "jsonrpc": "2.0",
    "id": 1,
    "method": "initialize",
    "params": {"protocolVersion": "2025-11-25", "capabilities": {}, "clientInfo": {"name": "t", "version": "0"}},
}


@dataclass
class Lab:
    idp: Provider
    jwt: ServerProcess  # takes JWTs for its /mcp
    opaque: ServerProcess  # takes opaque tokens for its /mcp, by introspection

    @property
    def resource(self) -> str:
        return f"{self.jwt.url}/mcp"

    @property
    def other(self) -> str:
        return f"{self.jwt.url}/other"  # another resource of the same provider

    @property
    def opaque_resource(self) -> str:
        return f"{self.opaque.url}/mcp"


@pytest.fixture(scope="module")
async def lab(service: Any) -> AsyncIterator[Lab]:
    jwt_server, opaque_server = ServerProcess("streamable-http"), ServerProcess("streamable-http")
    resources = {
        f"{jwt_server.url}/mcp": {"scope": SCOPES, "format": "jwt"},
        f"{jwt_server.url}/other": {"scope": SCOPES, "format": "jwt"},
        f"{opaque_server.url}/mcp": {"scope": SCOPES, "format": "opaque"},
        f"{opaque_server.url}/other": {"scope": SCOPES, "format": "opaque"},
    }
    async with running_provider(provider_config(resources, [KEY], CLIENTS)) as idp:
        with tempfile.TemporaryDirectory() as directory:
            first, second = Path(directory) / "jwt.toml", Path(directory) / "opaque.toml"
            oauth = {"issuer": idp.issuer, "resource": f"{jwt_server.url}/mcp", "metrics_scope": "mcp:metrics"}
            first.write_text(
                server_config(oauth, more='[metrics]\nreaders = ["ops"]\n[http.tokens]\nops = "ops-token-71"')
            )
            introspector = {"introspection_client_id": "mcp-server", "introspection_client_secret": "mcp-server-secret"}
            limits = {"introspection_cache_s": 1.0, "introspections_per_s": 1.0}
            second.write_text(
                server_config({**oauth, "resource": f"{opaque_server.url}/mcp", **introspector, **limits})
            )
            jwt_server.args, opaque_server.args = ["--config", str(first)], ["--config", str(second)]
            async with jwt_server, opaque_server:
                yield Lab(idp, jwt_server, opaque_server)


async def post(url: str, token: str | None, *, session: str | None = None) -> httpx2.Response:
    headers = {"accept": "application/json, text/event-stream"}
    if token is not None:
        headers["authorization"] = f"Bearer {token}"
    if session is not None:
        headers["mcp-session-id"] = session
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
        return await http.post(url, json=INITIALIZE, headers=headers)


def refused(answer: httpx2.Response, status: int = 401) -> bool:
    challenge = answer.headers.get("www-authenticate", "")
    return answer.status_code == status and "resource_metadata=" in challenge and 'scope="mcp:tools"' in challenge


async def test_without_a_token_the_challenge_names_the_metadata_and_the_scope_and_the_metadata_the_provider(
    lab: Lab,
) -> None:
    answer = await post(lab.resource, None)
    assert refused(answer), answer.headers
    assert "error=" not in answer.headers["www-authenticate"]  # no token was sent: no error code (RFC 6750 §3.1)
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
        for path in ("/.well-known/oauth-protected-resource/mcp", "/.well-known/oauth-protected-resource"):
            metadata = (await http.get(f"{lab.jwt.url}{path}")).json()
            assert metadata["resource"] == lab.resource, path
            assert metadata["authorization_servers"] == [lab.idp.issuer], path  # byte for byte, as published
            assert metadata["scopes_supported"] == ["mcp:tools"], path
    assert (await post(lab.resource, await lab.idp.token(lab.resource))).status_code == 200


async def test_a_token_for_another_resource_of_the_same_provider_is_refused(lab: Lab) -> None:
    answer = await post(lab.resource, await lab.idp.token(lab.other))
    assert refused(answer) and 'error="invalid_token"' in answer.headers["www-authenticate"]


async def test_a_token_of_another_issuer_signed_with_the_same_key_is_refused(lab: Lab) -> None:
    resources = {lab.resource: {"scope": SCOPES, "format": "jwt"}}
    async with running_provider(provider_config(resources, [KEY], CLIENTS)) as rogue:
        assert rogue.issuer != lab.idp.issuer
        assert refused(await post(lab.resource, await rogue.token(lab.resource)))


@pytest.mark.parametrize(("offset_s", "status"), [(-7200, 401), (3600, 401), (20, 200), (-615, 200)])
async def test_expired_and_not_yet_valid_tokens_are_refused_and_a_skew_within_the_leeway_is_not(
    lab: Lab, offset_s: int, status: int
) -> None:
    """A provider with the same issuer and key whose clock is shifted: its tokens expired long ago,
    are valid only from an hour on, are 20 s in the future, or expired 15 s ago (600 s to live),
    the last two within the 30 s leeway."""
    resources = {lab.resource: {"scope": SCOPES, "format": "jwt", "ttl": 600}}
    shifted = provider_config(resources, [KEY], CLIENTS, issuer=lab.idp.issuer, clock_offset_s=offset_s)
    async with running_provider(shifted) as clock:
        answer = await post(lab.resource, await clock.token(lab.resource))
    assert answer.status_code == status, answer.headers


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


async def test_a_forged_signature_alg_none_and_hmac_with_the_public_key_are_refused(lab: Lab) -> None:
    real = await lab.idp.token(lab.resource)
    head, body, signature = real.split(".")
    flipped = signature[:10] + ("A" if signature[10] != "A" else "B") + signature[11:]
    none = b64(json.dumps({"alg": "none", "typ": "at+jwt", "kid": "key-1"}).encode())
    pem = jwt.PyJWK(KEY).key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    hs = b64(json.dumps({"alg": "HS256", "typ": "at+jwt", "kid": "key-1"}).encode())
    mac = b64(hmac.new(pem, f"{hs}.{body}".encode(), hashlib.sha256).digest())
    for forged in (f"{head}.{body}.{flipped}", f"{none}.{body}.", f"{hs}.{body}.{mac}"):
        assert refused(await post(lab.resource, forged)), forged[:40]
    assert (await post(lab.resource, real)).status_code == 200


async def test_a_token_signed_with_a_key_the_provider_does_not_publish_is_refused(lab: Lab) -> None:
    resources = {lab.resource: {"scope": SCOPES, "format": "jwt"}}
    async with running_provider(provider_config(resources, [STRANGER], CLIENTS, issuer=lab.idp.issuer)) as other:
        token = await other.token(lab.resource)
    assert jwt.get_unverified_header(token)["kid"] == "key-2"
    assert refused(await post(lab.resource, token))


async def test_a_token_without_the_required_scope_gets_403_with_the_scope_to_ask_for(lab: Lab) -> None:
    answer = await post(lab.resource, await lab.idp.token(lab.resource, scope="mcp:metrics"))
    assert refused(answer, 403) and 'error="insufficient_scope"' in answer.headers["www-authenticate"]


async def test_a_revoked_opaque_token_is_refused_once_its_introspection_is_no_longer_trusted(lab: Lab) -> None:
    token = await lab.idp.token(lab.opaque_resource)
    assert "." not in token  # opaque: only introspection can say what it is
    assert (await post(lab.opaque_resource, token)).status_code == 200
    assert refused(await post(lab.resource, token))  # the JWT server has no introspection
    await lab.idp.revoke(token)
    statuses: list[int] = []

    async def refused_now() -> bool:
        statuses.append((await post(lab.opaque_resource, token)).status_code)
        return statuses[-1] == 401

    with anyio.fail_after(20):  # introspection_cache_s = 1 there
        while not await refused_now():  # noqa: ASYNC110 - polls the server's answer, the state under test
            await anyio.sleep(0.2)
    assert statuses[-1] == 401


async def test_an_opaque_token_for_another_resource_is_refused_by_what_introspection_says(lab: Lab) -> None:
    token = await lab.idp.token(f"{lab.opaque.url}/other")
    assert refused(await post(lab.opaque_resource, token))


async def test_made_up_opaque_tokens_cannot_make_the_server_flood_the_provider(lab: Lab) -> None:
    before = lab.idp.requests("POST", "/token/introspection")
    with anyio.fail_after(60):
        answers = [await post(lab.opaque_resource, f"made-up-{n}") for n in range(30)]
    assert {answer.status_code for answer in answers} == {401}
    asked = lab.idp.requests("POST", "/token/introspection") - before
    assert 1 <= asked <= 12, asked  # introspections_per_s = 1 there: a burst of 2, then one a second


async def test_tokens_are_not_checked_where_no_route_needs_one(lab: Lab) -> None:
    before = lab.idp.requests("POST", "/token/introspection")
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
        for n in range(10):
            headers = {"authorization": f"Bearer unchecked-{n}"}
            assert (await http.get(f"{lab.opaque.url}/healthz", headers=headers)).status_code == 200
            found = await http.get(f"{lab.opaque.url}/.well-known/oauth-protected-resource", headers=headers)
            assert found.status_code == 200
            assert (await http.get(f"{lab.opaque.url}/files/nope-{n}", headers=headers)).status_code == 404
    assert lab.idp.requests("POST", "/token/introspection") == before


async def test_two_authorization_headers_are_refused(lab: Lab) -> None:
    good = await lab.idp.token(lab.resource)
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
        headers = [("authorization", "Bearer nope"), ("authorization", f"Bearer {good}")]
        answer = await http.post(lab.resource, json=INITIALIZE, headers=headers)
    assert answer.status_code == 400


async def test_another_identitys_mcp_session_is_not_found(lab: Lab) -> None:
    first = await post(lab.resource, await lab.idp.token(lab.resource))
    session = first.headers["mcp-session-id"]
    other = await post(lab.resource, await lab.idp.token(lab.resource, client="machine-2"), session=session)
    assert other.status_code == 404


async def test_metrics_take_a_token_with_the_metrics_scope_or_a_listed_static_token(lab: Lab) -> None:
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:

        async def metrics(token: str) -> int:
            return (await http.get(f"{lab.jwt.url}/metrics", headers={"authorization": f"Bearer {token}"})).status_code

        assert await metrics(await lab.idp.token(lab.resource, scope="mcp:tools mcp:metrics")) == 200
        assert await metrics(await lab.idp.token(lab.resource)) == 403
        assert await metrics("ops-token-71") == 200
        assert await metrics("made-up") == 401


async def dpop_bound_token(idp: Provider, resource: str) -> str:
    """A client-credentials token the provider binds to a key of the client's (RFC 9449: DPoP)."""
    key = ec.generate_private_key(ec.SECP256R1())
    public = json.loads(ECAlgorithm.to_jwk(key.public_key()))
    claims = {"htm": "POST", "htu": f"{idp.url}/token", "iat": int(time.time()), "jti": str(uuid.uuid4())}
    proof = jwt.encode(claims, key, algorithm="ES256", headers={"typ": "dpop+jwt", "jwk": public})
    async with httpx2.AsyncClient(timeout=30, trust_env=False) as http:
        answer = await http.post(
            f"{idp.url}/token",
            data={"grant_type": "client_credentials", "resource": resource, "scope": "mcp:tools"},
            auth=("machine-1", "machine-1-secret"),
            headers={"dpop": proof},
        )
    assert answer.status_code == 200 and answer.json()["token_type"] == "DPoP", answer.text
    return str(answer.json()["access_token"])


async def test_a_token_bound_to_a_clients_key_is_refused_as_a_bearer_token(lab: Lab) -> None:
    """Whoever holds a DPoP-bound token without the client's key (a stolen one) cannot use it here:
    this server checks no proof of possession, so it takes no bound token, JWT or opaque."""
    bound = await dpop_bound_token(lab.idp, lab.resource)
    assert "jkt" in jwt.decode(bound, options={"verify_signature": False})["cnf"]
    assert refused(await post(lab.resource, bound))
    assert refused(await post(lab.opaque_resource, await dpop_bound_token(lab.idp, lab.opaque_resource)))


async def test_made_up_opaque_tokens_cannot_lock_out_a_client_already_signed_in(lab: Lab) -> None:
    """Made-up tokens keep the introspection bucket empty (one a second there); a token accepted
    before is asked about again once its answer is no longer trusted (a second there) all the same."""
    token = await lab.idp.token(lab.opaque_resource)
    # Its first use takes a token of the bucket unknown tokens share, which the tests before this one
    # may have emptied: it signs in once the bucket has one again (a second at most, bounded here).
    with anyio.fail_after(10):
        while (await post(lab.opaque_resource, token)).status_code != 200:  # noqa: ASYNC110 - the server's bucket
            await anyio.sleep(0.2)
    statuses: list[int] = []

    async def flood(worker: int) -> None:
        for n in range(40):
            await post(lab.opaque_resource, f"made-up-{worker}-{n}")

    with anyio.fail_after(120):
        async with anyio.create_task_group() as tg:
            for worker in range(4):
                tg.start_soon(flood, worker)
            for _ in range(6):
                await anyio.sleep(0.6)  # past introspection_cache_s: each call asks the provider again
                statuses.append((await post(lab.opaque_resource, token)).status_code)
    assert statuses == [200] * 6, statuses
