"""The sections of the server's faces: ``[http]`` (tokens, guards, limits of a connection),
``[metrics]`` (who reads them), ``[stdio]`` (the local service) and ``[files]`` (file URLs)."""

from __future__ import annotations

from pydantic import Field, SecretStr

from .oauth import OAuthSettings
from .sections import Section
from .units import MIB


class HttpSettings(Section):
    token: SecretStr | None = Field(None, description="bearer token (prefer the environment variable)")
    tokens: dict[str, SecretStr] = Field(
        default_factory=dict, description="more bearer tokens, one per client identity: name = token"
    )
    oauth: OAuthSettings | None = Field(
        None, description="accept OAuth 2.1 access tokens of an authorization server (see [http.oauth])"
    )
    allowed_hosts: list[str] = Field(default_factory=list, description="extra Host values to accept")
    allowed_origins: list[str] = Field(default_factory=list, description="extra Origin values to accept")
    max_body_mb: int = Field(16, ge=1, description="largest request body")
    header_timeout_s: float = Field(
        10.0, gt=0, description="a request's headers must arrive within this of their first byte"
    )
    keep_alive_s: int = Field(
        20,
        ge=1,
        le=3600,
        description="an idle connection between requests is closed after this: longer than clients keep theirs "
        "(httpx 5 s, Node 4 s), so that no client sends a request on a connection the server is closing",
    )
    max_connections: int = Field(2000, ge=16, description="open HTTP connections at once; more are refused")
    max_connections_per_client: int = Field(
        200,
        ge=2,
        description="open HTTP connections one client may hold (its token, or file URLs it made); more get 429",
    )
    body_timeout_s: float = Field(
        30.0, gt=0, description="once a request's headers are in, its body must arrive within this (see body_min_rate)"
    )
    body_min_rate_kib_s: float = Field(
        64.0,
        gt=0,
        description="each this many KiB of a body that arrived buys it a second more than body_timeout_s: "
        "a body that averages less is cut",
    )
    response_timeout_s: float = Field(
        30.0,
        gt=0,
        description="an answer the client stops reading (more of it waiting than the socket takes) must be read "
        "within this (see response_min_rate), else the connection is aborted",
    )
    response_min_rate_kib_s: float = Field(
        64.0,
        gt=0,
        description="each this many KiB of a waiting answer the client read buys it a second more than "
        "response_timeout_s",
    )

    @property
    def max_body_bytes(self) -> int:
        return self.max_body_mb * MIB


class MetricsSettings(Section):
    """Who may read the Prometheus metrics (``GET /metrics`` on the HTTP transports, ``--metrics-port``)."""

    public: bool = Field(
        False, description="serve /metrics to anyone, without a token (the metrics hold no ids, paths or user data)"
    )
    readers: list[str] = Field(
        default_factory=list,
        description="identities (names of [http.tokens], or 'default') whose token may read /metrics",
    )
    host: str = Field(
        "127.0.0.1", description="address of the --metrics-port listener; not loopback only with public = true"
    )


class StdioSettings(Section):
    identity: str | None = Field(
        None,
        pattern=r"^[A-Za-z0-9][A-Za-z0-9._@-]{0,63}$",
        description="the identity stdio clients have (also MCP_CODE_EXEC_IDENTITY); default: the OS user",
    )
    idle_exit_s: float = Field(
        600.0, gt=0, description="the local service stdio clients share exits this long after its last connection"
    )
    start_timeout_s: float = Field(
        60.0, gt=0, description="a stdio front waits this long (plus engine_wait_s) for the local service to start"
    )


class FileSettings(Section):
    url_ttl_s: float = Field(600.0, gt=0, description="how long a URL from the file_url tool stays valid")
    max_upload_mb: int = Field(
        1024, ge=1, description="largest upload through a URL (the session's quota and limits.fsize_mb apply too)"
    )
    public_base_url: str | None = Field(
        None,
        pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$",
        description="what file URLs start with, e.g. https://sandbox.example.com behind a proxy; "
        "default: http:// and the Host the client reached the server by",
    )
    stall_timeout_s: float = Field(
        60.0, gt=0, description="a transfer through a URL that moves no bytes this long ends"
    )
    busy_wait_s: float = Field(
        2.0, ge=0, description="a transfer through a URL waits this long for its session held by another, then gets 409"
    )

    @property
    def max_upload_bytes(self) -> int:
        return self.max_upload_mb * MIB
