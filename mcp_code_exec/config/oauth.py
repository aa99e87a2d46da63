"""The ``[http.oauth]`` section: the HTTP transports as an OAuth 2.1 resource server.

With it, a client brings an access token that the authorization server named by ``issuer`` made for
this server (``resource``, RFC 8707), and the token's ``identity_claim`` names the identity that owns
sessions, runs and files (``oauth:<issuer> <claim>=<value>``, see ``mcp_server.http.oauth_verifier``).
Static tokens (``[http.tokens]``) keep working beside it. Without the section (the default), HTTP
takes static tokens only. Bad values are refused when the file is loaded, with the reason.
"""

from __future__ import annotations

import ipaddress
import re
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

# Asymmetric JWS algorithms only: ``none`` and the HMAC ones (whose key would be a secret the
# provider shares with every resource server) are never accepted.
ASYMMETRIC = ("RS256", "RS384", "RS512", "PS256", "PS384", "PS512", "ES256", "ES384", "ES512", "EdDSA")
SCOPE_TOKEN = re.compile(r"[\x21\x23-\x5b\x5d-\x7e]+")  # RFC 6749 §3.3
CLAIM_NAME = re.compile(r"[A-Za-z0-9_.:-]{1,64}")
MAX_LEEWAY_S = 60.0


def _refused(reason: str) -> PydanticCustomError:
    return PydanticCustomError("oauth", "{reason}", {"reason": reason})


def url_problem(url: str, what: str) -> str | None:
    """Why ``url`` cannot be an issuer or resource identifier (None: it can). https, or http on a
    loopback host; no whitespace, query or fragment (RFC 8414 §2, RFC 8707 §2)."""
    try:
        parts = urlsplit(url)
        host = parts.hostname or ""
    except ValueError as exc:
        return f"{what} {url!r} is not a URL ({exc})"
    if any(character.isspace() for character in url) or not host:
        return f"{what} {url!r} is not a URL"
    if parts.query or parts.fragment or "#" in url:
        return f"{what} {url!r} may have no query or fragment"
    if parts.scheme == "https" or (parts.scheme == "http" and _loopback(host)):
        return None
    return f"{what} {url!r} must be https (http only on a loopback address)"


def _loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class OAuthSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    issuer: str = Field(
        description="the authorization server, exactly as it publishes itself (its metadata's issuer, the "
        "tokens' iss; mind a trailing slash); its metadata gives the keys and the introspection endpoint",
    )
    resource: str = Field(
        description="this server's canonical URL as clients reach it (the /mcp or /sse endpoint): "
        "the protected-resource metadata names it, and tokens must be issued for it",
    )
    audience: str | None = Field(
        None,
        description="the aud a token must carry, where the provider does not use the resource itself "
        "(Entra ID's application ID URI, a Keycloak client id); default: resource",
    )
    scopes: list[str] = Field(["mcp:tools"], description="scopes a token must hold for every MCP call")
    identity_claim: str = Field("sub", description="the claim that names the identity (sessions, runs, files)")
    metrics_scope: str | None = Field(None, description="a token with this scope may also read /metrics")
    algorithms: list[str] = Field(
        ["RS256", "PS256", "ES256", "EdDSA"], description="signature algorithms accepted (asymmetric only)"
    )
    leeway_s: float = Field(
        30.0, ge=0, le=MAX_LEEWAY_S, description="clock skew allowed on exp, nbf and iat, in seconds (at most 60)"
    )
    introspection_client_id: str | None = Field(
        None, description="this server's client id at the provider, to introspect opaque tokens (RFC 7662)"
    )
    introspection_client_secret: SecretStr | None = Field(
        None, description="its secret (prefer MCP_CODE_EXEC_OAUTH_CLIENT_SECRET)"
    )
    introspection_cache_s: float = Field(
        30.0, ge=0, le=300, description="an introspected token is trusted this long (a revocation takes effect then)"
    )
    introspections_per_s: float = Field(
        10.0, gt=0, description="introspection calls at most, per second on average (bursts of twice as many)"
    )

    @field_validator("issuer", "resource")
    @classmethod
    def _url(cls, value: str, info: ValidationInfo) -> str:
        problem = url_problem(value, str(info.field_name))
        if problem is not None:
            raise _refused(problem)
        return value

    @field_validator("audience")
    @classmethod
    def _audience(cls, value: str | None) -> str | None:
        if value is not None and (not value or len(value) > 512 or not value.isprintable() or " " in value):
            raise _refused(f"audience {value!r} must be a short printable string without spaces")
        return value

    @field_validator("scopes")
    @classmethod
    def _scope_tokens(cls, value: list[str]) -> list[str]:
        for scope in value:
            if not SCOPE_TOKEN.fullmatch(scope):
                raise _refused(f"{scope!r} is not a scope (printable ASCII, no spaces, quotes or backslashes)")
        return value

    @field_validator("metrics_scope")
    @classmethod
    def _metrics_scope(cls, value: str | None) -> str | None:
        if value is not None and not SCOPE_TOKEN.fullmatch(value):
            raise _refused(f"{value!r} is not a scope (printable ASCII, no spaces, quotes or backslashes)")
        return value

    @field_validator("identity_claim")
    @classmethod
    def _claim(cls, value: str) -> str:
        if not CLAIM_NAME.fullmatch(value):
            raise _refused(f"{value!r} is not a claim name (letters, digits, '_', '.', ':', '-')")
        return value

    @field_validator("algorithms")
    @classmethod
    def _asymmetric(cls, value: list[str]) -> list[str]:
        bad = [alg for alg in value if alg not in ASYMMETRIC]
        if bad or not value:
            raise _refused(f"{bad or value}: only asymmetric JWS algorithms are accepted ({', '.join(ASYMMETRIC)})")
        return value

    @model_validator(mode="after")
    def _introspector_whole(self) -> OAuthSettings:
        if (self.introspection_client_id is None) != (self.introspection_client_secret is None):
            raise _refused("introspection needs both introspection_client_id and introspection_client_secret")
        return self

    @property
    def expected_audience(self) -> str:
        return self.audience or self.resource

    @property
    def introspects(self) -> bool:
        return self.introspection_client_id is not None
