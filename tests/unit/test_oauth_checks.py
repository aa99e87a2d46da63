"""The OAuth resource server's bookkeeping and parsing, without a provider: the ``[http.oauth]``
section, the identities tokens name, the token checks against keys held in memory (tokens made
here with PyJWT), the caches and the introspection bucket.

The same refusals against a real authorization server are in ``tests/engine/test_oauth_refusals.py``.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import time
from typing import Any

import jwt
import pytest
from cryptography.hazmat.primitives.asymmetric import rsa
from cryptography.hazmat.primitives.serialization import Encoding, PublicFormat
from jwt.algorithms import RSAAlgorithm

from mcp_code_exec.config.oauth import OAuthSettings
from mcp_code_exec.config.settings import load_config
from mcp_code_exec.errors import ConfigError
from mcp_code_exec.mcp_server.http.auth import http_authenticator
from mcp_code_exec.mcp_server.http.host import ServeOptions, check_http_options
from mcp_code_exec.mcp_server.http.oauth_keys import json_depth, parse_jwks
from mcp_code_exec.mcp_server.http.oauth_verifier import Bucket, OAuthVerifier, TTLCache, granted
from mcp_code_exec.sandbox.records import identity_realm, oauth_identity

ISSUER = "https://auth.example.com/"
RESOURCE = "https://mcp.example.com/mcp"


def private_jwk(kid: str) -> dict[str, Any]:
    key = rsa.generate_private_key(public_exponent=65537, key_size=2048)
    jwk: dict[str, Any] = json.loads(RSAAlgorithm.to_jwk(key))
    jwk.update(kid=kid, use="sig", alg="RS256")
    return jwk


KEY = private_jwk("k1")


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode()


def claims(**changes: Any) -> dict[str, Any]:
    now = int(time.time())
    made = {"iss": ISSUER, "aud": RESOURCE, "sub": "alice", "iat": now, "nbf": now, "exp": now + 300}
    made.update(scope="mcp:tools", client_id="app-1")
    made.update(changes)
    return {name: value for name, value in made.items() if value is not None}


def token(key: dict[str, Any] = KEY, header: dict[str, Any] | None = None, **changes: Any) -> str:
    headers = {"kid": key["kid"], "typ": "at+jwt", **(header or {})}
    return jwt.encode(claims(**changes), jwt.PyJWK(key).key, algorithm="RS256", headers=headers)


def verifier(**settings: Any) -> OAuthVerifier:
    made = OAuthVerifier(OAuthSettings(issuer=ISSUER, resource=RESOURCE, **settings))
    made.keys.held = parse_jwks({"keys": [KEY]}, time.monotonic())  # private members are dropped
    made.keys.attempted = time.monotonic()  # no fetch: an unknown kid is refused at once
    return made


async def check(made: OAuthVerifier, presented: str) -> Any:
    # Awaited in async tests, never anyio.run: with the engine tier's session-scoped service alive in
    # the same pytest process, anyio keeps its event loop, and a nested anyio.run is refused.
    return await made.verify_token(presented)


@pytest.mark.anyio
async def test_a_token_of_this_issuer_for_this_server_names_an_identity_of_its_issuer_and_subject() -> None:
    made = verifier()
    exp = int(time.time()) + 300
    principal = await check(made, token(exp=exp))
    assert principal is not None, made.last_refusal
    assert principal.identity == f"oauth:{ISSUER} sub=alice" == oauth_identity(ISSUER, "sub", "alice")
    assert (principal.subject, principal.client_id, principal.resource) == ("alice", "app-1", RESOURCE)
    assert principal.expires_at == exp + 30  # the SDK's own exp check sees the leeway too
    assert "d" not in made.keys.held.keys["k1"]


@pytest.mark.parametrize(
    ("presented", "reason"),
    [
        (lambda: token(aud="https://mcp.example.com/other"), "InvalidAudienceError"),
        (lambda: token(iss="https://evil.example.com/"), "InvalidIssuerError"),
        (lambda: token(exp=int(time.time()) - 60), "ExpiredSignatureError"),
        (lambda: token(nbf=int(time.time()) + 60), "ImmatureSignatureError"),
        (lambda: token(iat=int(time.time()) + 60), "ImmatureSignatureError"),
        (lambda: token(exp=None), "MissingRequiredClaimError"),
        (lambda: token(private_jwk("k1")), "InvalidSignatureError"),
        (lambda: token(private_jwk("k9")), "no key 'k9'"),
        (lambda: token(header={"typ": "JWT+id"}), "not an access token's"),
        (lambda: token(header={"crit": ["exp"]}), "critical header"),
        (lambda: token(nonce="n-1"), "an ID token"),
        (lambda: token(cnf={"jkt": "0ZcOCORZNYy-DWpqq30jZyJGHTN0d2HglBV3uiguA4I"}), "sender-constrained"),
        (lambda: token(sub=""), "names no identity"),
        (lambda: token(sub="x" * 257), "names no identity"),
        (lambda: token(sub="a\nb"), "names no identity"),
        (lambda: "a" * 9000, "longer than 8192"),
        (lambda: "a.b.c.d.e", "JWE"),
        (lambda: "bad token", "characters"),
        (lambda: "opaque-token", "no introspection is configured"),
    ],
)
@pytest.mark.anyio
async def test_a_token_that_fails_any_check_is_refused_with_its_reason(presented: Any, reason: str) -> None:
    made = verifier()
    assert await check(made, presented()) is None
    assert reason in (made.last_refusal or ""), made.last_refusal


@pytest.mark.anyio
async def test_within_the_leeway_exp_nbf_and_iat_are_accepted_alike() -> None:
    for name, shift in (("exp", -15), ("nbf", 15), ("iat", 15)):  # the leeway is 30 s
        made, shifted = verifier(), {name: int(time.time()) + shift}
        assert await check(made, token(**dict[str, Any](shifted))) is not None, (name, made.last_refusal)


@pytest.mark.anyio
async def test_alg_none_and_hmac_keyed_with_the_public_key_are_refused() -> None:
    body = token().split(".")[1]
    none = b64(json.dumps({"alg": "none", "kid": "k1"}).encode())
    pem = jwt.PyJWK(KEY).key.public_key().public_bytes(Encoding.PEM, PublicFormat.SubjectPublicKeyInfo)
    hs_head = b64(json.dumps({"alg": "HS256", "kid": "k1"}).encode())
    mac = b64(hmac.new(pem, f"{hs_head}.{body}".encode(), hashlib.sha256).digest())
    forgeries = ((f"{none}.{body}.", "'none' is not accepted"), (f"{hs_head}.{body}.{mac}", "'HS256' is not accepted"))
    for forged, reason in forgeries:
        made = verifier()
        assert await check(made, forged) is None
        assert reason in (made.last_refusal or "")


@pytest.mark.anyio
async def test_nesting_is_refused_before_the_claims_are_parsed() -> None:
    head = token().split(".")[0]
    deep = b64(b"[" * 2000 + b"]" * 2000)
    made = verifier()
    assert await check(made, f"{head}.{deep}.sig") is None
    assert "nested deeper" in (made.last_refusal or "")
    assert json_depth(b'{"a": "[[[[[[", "b": [[1]]}') == 3  # brackets inside strings do not count


@pytest.mark.anyio
async def test_a_missing_scope_is_left_out_for_the_sdk_to_answer_403() -> None:
    principal = await check(verifier(), token(scope="other"))
    assert principal is not None and principal.scopes == ["other"]


@pytest.mark.anyio
async def test_entra_ids_scp_holds_a_uri_scope_by_its_last_part() -> None:
    made = verifier(scopes=["api://mcp-app/mcp.tools"], audience="api://mcp-app")
    principal = await check(made, token(aud="api://mcp-app", scope=None, scp="mcp.tools"))
    assert principal is not None, made.last_refusal
    assert principal.scopes == ["mcp.tools", "api://mcp-app/mcp.tools"]
    assert granted("mcp:tools", ["mcp:tools"]) and not granted("mcp:tools", ["tools"])
    assert not granted("api://mcp-app/mcp.tools", ["api://other/mcp.tools"])


def test_identities_of_two_issuers_of_static_tokens_and_of_stdio_never_meet() -> None:
    assert identity_realm(oauth_identity("https://a/x=y", "sub", "v=w")) == identity_realm(
        oauth_identity("https://a/x=y", "sub", "z")
    )
    assert identity_realm("token:alice") == identity_realm("user:alice") == ""
    one, two = oauth_identity("https://a.example/", "sub", "x"), oauth_identity("https://a.example", "sub", "x")
    assert one != two
    assert oauth_identity("https://a.example/", "sub", "b c") != oauth_identity("https://a.example/", "sub", "b")
    assert not one.startswith(("token:", "user:", "local:"))  # static tokens' and stdio clients' identities


@pytest.mark.anyio
async def test_a_client_alone_and_a_user_whose_subject_is_spelt_as_its_id_are_two_identities() -> None:
    """Client credentials at oidc-provider and Okta: the token's sub is its client's id."""
    made = verifier()
    machine, user = (
        await check(made, token(sub="app-1", client_id="app-1")),
        await check(made, token(sub="app-1", client_id="app-9")),
    )
    assert machine is not None and user is not None
    assert machine.identity == oauth_identity(ISSUER, "client_id", "app-1")
    assert user.identity == oauth_identity(ISSUER, "sub", "app-1") != machine.identity
    by_azp = await check(made, token(sub="app-2", client_id=None, azp="app-2"))
    assert by_azp is not None and by_azp.identity == oauth_identity(ISSUER, "client_id", "app-2")


@pytest.mark.anyio
async def test_a_refused_token_is_remembered_briefly_and_an_accepted_one_until_its_expiry_at_most() -> None:
    made = verifier()
    good = token(exp=int(time.time()) + 10)
    assert await check(made, good) is not None
    until, _ = made.results.items[next(iter(made.results.items))]
    assert until - time.monotonic() <= 10 + 30 + 1  # exp plus the leeway, below RESULT_CACHE_S
    assert await check(made, good) is not None  # from memory
    assert await check(made, "a.b.c") is None and len(made.results.items) == 2


def test_the_bucket_allows_a_burst_then_its_rate() -> None:
    now = [0.0]
    bucket = Bucket(10, 20, lambda: now[0])
    assert sum(bucket.take() for _ in range(50)) == 20
    now[0] += 0.5
    assert sum(bucket.take() for _ in range(50)) == 5


def test_the_cache_keeps_its_bound_and_forgets_at_its_deadline() -> None:
    now = [0.0]
    cache: TTLCache[int] = TTLCache(3, lambda: now[0])
    for index in range(5):
        cache.put(str(index), index, 10)
    assert list(cache.items) == ["2", "3", "4"]
    now[0] = 10
    assert cache.get("4") == (False, None)


@pytest.mark.parametrize(
    ("section", "reason"),
    [
        ('issuer = "http://auth.example.com/"', "must be https"),
        ('issuer = "https://auth.example.com/?tenant=1"', "no query or fragment"),
        ('algorithms = ["HS256"]', "only asymmetric"),
        ('algorithms = ["none"]', "only asymmetric"),
        ("leeway_s = 61", "less than or equal to 60"),
        ('scopes = ["mcp tools"]', "is not a scope"),
        ('identity_claim = "a b"', "is not a claim name"),
        ('introspection_client_id = "rs"', "needs both"),
    ],
)
def test_the_section_refuses_what_would_weaken_the_checks(tmp_path: Any, section: str, reason: str) -> None:
    lines = {"issuer": f'issuer = "{ISSUER}"', "resource": f'resource = "{RESOURCE}"'}
    lines[section.split(" ")[0]] = section
    path = tmp_path / "config.toml"
    path.write_text("[http.oauth]\n" + "\n".join(lines.values()) + "\n")
    with pytest.raises(ConfigError, match=reason):
        load_config(path, environ={})


def test_the_introspection_secret_comes_from_the_environment_into_the_files_section(tmp_path: Any) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f'[http.oauth]\nissuer = "{ISSUER}"\nresource = "{RESOURCE}"\nintrospection_client_id = "rs"\n')
    loaded = load_config(path, environ={"MCP_CODE_EXEC_OAUTH_CLIENT_SECRET": "s3cret"})
    assert loaded.http.oauth is not None and loaded.http.oauth.introspects
    assert "s3cret" not in repr(loaded)
    assert load_config(None, environ={"MCP_CODE_EXEC_OAUTH_CLIENT_SECRET": "s3cret"}).http.oauth is None


def test_each_listener_takes_the_kinds_of_token_it_is_told_and_makes_one_up_only_without_either(
    tmp_path: Any, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / "config.toml"
    path.write_text(f'[http.tokens]\nops = "ops-token"\n[http.oauth]\nissuer = "{ISSUER}"\nresource = "{RESOURCE}"\n')
    both = load_config(path, environ={})
    assert http_authenticator(both.http, "both", "here").static.tokens == {"ops": "ops-token"}
    assert http_authenticator(both.http, "oauth", "here").static.tokens == {}
    assert http_authenticator(both.http, "tokens", "here").oauth is None
    beyond = ServeOptions(transport="streamable-http", host="0.0.0.0", port=0, auth="oauth")
    check_http_options(both.http.model_copy(update={"tokens": {}}), both.metrics, beyond)
    with pytest.raises(ConfigError, match=r"needs an \[http.oauth\]"):
        http_authenticator(load_config(None, environ={}).http, "oauth", "here")
    made_up = http_authenticator(load_config(None, environ={}).http, "both", "here")
    assert list(made_up.static.tokens) == ["default"] and made_up.oauth is None
