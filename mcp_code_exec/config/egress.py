"""``[egress]``: the hosts sandboxes may reach through the server's proxy, and what the proxy adds.

A non-empty ``allow`` turns egress on for every sandbox; an entry with ``principals`` is only for
those identities (read as code mode reads them, see ``principals``). Everything is checked as the
file loads: a bad pattern, a range that holds the proxy's own loopback, a secret for a host no
entry allows or whose variable is not set is one clear line at start, never a failure at the
first request. Secret values are read from the host's environment when the proxy starts and go to
the proxy alone.
"""

from __future__ import annotations

import ipaddress
import os
import re
from pathlib import Path
from typing import Any

from pydantic import Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

from .hostpatterns import Pattern, normalise_host, parse_pattern
from .sections import Section
from .units import MIB

DEFAULT_IMAGE = "mcp-code-exec-egress:latest"
MAX_ENTRIES = 256
HEADER_NAME = re.compile(r"^[A-Za-z0-9!#$%&'*+.^_`|~-]{1,64}$")  # an HTTP token
# Headers the proxy itself must own: injecting one of them would break or smuggle the request.
RESERVED_HEADERS = {
    "host", "content-length", "transfer-encoding", "connection", "upgrade", "te", "trailer",
    "proxy-authorization", "proxy-connection", "keep-alive",
}  # fmt: skip
# The proxy's own loopback (its listener) is never a destination, whatever the configuration says.
PROXY_OWN = (ipaddress.ip_network("127.0.0.0/8"), ipaddress.ip_network("::1/128"), ipaddress.ip_network("0.0.0.0/8"))


def refused(message: str) -> PydanticCustomError:
    return PydanticCustomError("egress", "{reason}", {"reason": message})


class AllowEntry(Section):
    host: str = Field(description='a host pattern: "name", "*.suffix", an IP literal, each with an optional ":port"')
    principals: list[str] | None = Field(None, description="identities that may reach it (default: all)")

    @field_validator("host")
    @classmethod
    def _pattern(cls, value: str) -> str:
        try:
            pattern = parse_pattern(value)
        except ValueError as exc:
            raise refused(str(exc)) from None
        ip = pattern.literal
        if ip is not None and (ip.is_loopback or ip.is_unspecified or ip.is_multicast):
            raise refused(f"{value!r}: the proxy's own loopback, an unspecified or a multicast address is no host")
        return pattern.text

    def pattern(self) -> Pattern:
        return parse_pattern(self.host)


class EgressSecret(Section):
    host: str = Field(description="a host name allowed above (the header goes to it on any of its allowed ports)")
    header: str = Field(description="the header the proxy sets (a header of that name from the sandbox is replaced)")
    value_env: str = Field(description="the host's environment variable holding the value, read when the proxy starts")
    value_prefix: str = Field("", description='put before the value, e.g. "Bearer "')

    @field_validator("host")
    @classmethod
    def _name(cls, value: str) -> str:
        normal = normalise_host(value)
        if normal is None or normal != value.strip().rstrip(".").lower() or parse_pattern(normal).literal:
            raise refused(f"{value!r}: a secret's host is one host name, written as an allow entry names it")
        return normal

    @field_validator("header")
    @classmethod
    def _header(cls, value: str) -> str:
        if not HEADER_NAME.match(value) or value.lower() in RESERVED_HEADERS:
            raise refused(f"{value[:80]!r} is not a header the proxy may set")
        return value

    @field_validator("value_env")
    @classmethod
    def _is_set(cls, value: str, info: ValidationInfo) -> str:
        environ = (info.context or {}).get("environ", os.environ)
        if not environ.get(value):
            raise refused(f"the environment variable {value[:80]!r} is not set (or empty)")
        return value

    @field_validator("value_prefix")
    @classmethod
    def _one_line(cls, value: str) -> str:
        if any((ord(ch) < 0x20 and ch != "\t") or ord(ch) == 0x7F for ch in value):
            raise refused("the prefix holds a control character")
        return value


class EgressSettings(Section):
    allow: list[AllowEntry] = Field(
        default_factory=list, max_length=MAX_ENTRIES, description="host patterns sandboxes may reach (empty: none)"
    )
    upstream_ca: Path | None = Field(None, description="extra CAs (PEM) the proxy trusts for upstreams")
    private_ranges: list[str] = Field(
        default_factory=list, description="private ranges an allowed name may resolve into (internal services)"
    )
    secrets: list[EgressSecret] = Field(default_factory=list, max_length=64, description="headers added per host")
    budget_run_mb: int = Field(0, ge=0, description="bytes one run may move through the proxy, in MiB (0: no cap)")
    budget_day_mb: int = Field(0, ge=0, description="bytes one identity may move per UTC day, in MiB (0: no cap)")
    hosts_file: Path = Field(Path("/etc/hosts"), description="names the proxy resolves before DNS (the host's)")
    state_dir: Path | None = Field(None, description="the deployment CA and the day counters; default ~/.local/state")
    image: str = Field(DEFAULT_IMAGE, description="the proxy's image (mcp-code-exec image egress)")
    memory_mb: int = Field(256, ge=64, le=65536, description="the proxy container's memory")

    @property
    def memory_bytes(self) -> int:
        return self.memory_mb * MIB

    @property
    def budget_run_bytes(self) -> int:
        return self.budget_run_mb * MIB

    @property
    def budget_day_bytes(self) -> int:
        return self.budget_day_mb * MIB

    @model_validator(mode="before")
    @classmethod
    def _entries(cls, data: Any) -> Any:
        if isinstance(data, dict) and isinstance(data.get("allow"), list):
            data = {**data, "allow": [{"host": item} if isinstance(item, str) else item for item in data["allow"]]}
        return data

    @field_validator("allow")
    @classmethod
    def _distinct(cls, value: list[AllowEntry]) -> list[AllowEntry]:
        seen: set[tuple[str, tuple[int, ...]]] = set()
        for entry in value:
            pattern = entry.pattern()
            if (pattern.host, pattern.ports) in seen:
                raise refused(f"{entry.host!r} is listed twice")
            seen.add((pattern.host, pattern.ports))
        return value

    @field_validator("upstream_ca")
    @classmethod
    def _readable(cls, value: Path | None) -> Path | None:
        if value is None:
            return None
        path = value.expanduser()
        try:
            text = path.read_text(errors="replace")
        except OSError as exc:
            raise refused(f"{value}: cannot read it ({exc.strerror})") from None
        if "-----BEGIN CERTIFICATE-----" not in text:
            raise refused(f"{value}: no PEM certificate in it")
        return path

    @field_validator("private_ranges")
    @classmethod
    def _ranges(cls, value: list[str]) -> list[str]:
        for text in value:
            try:
                network = ipaddress.ip_network(text)
            except ValueError as exc:
                raise refused(f"{text!r} is not a network such as 10.20.0.0/16 ({exc})") from None
            if any(network.version == own.version and network.overlaps(own) for own in PROXY_OWN):
                raise refused(f"{text!r} holds the proxy's own loopback, which is never a destination")
        return value

    @field_validator("secrets")
    @classmethod
    def _secret_hosts(cls, value: list[EgressSecret], info: ValidationInfo) -> list[EgressSecret]:
        allow = info.data.get("allow") or []
        for secret in value:
            if not any(entry.pattern().names(secret.host) for entry in allow):
                raise refused(f"the secret's host {secret.host!r} is not allowed by any entry of [egress] allow")
        return value

    @property
    def enabled(self) -> bool:
        return bool(self.allow)

    def patterns(self) -> list[Pattern]:
        return [entry.pattern() for entry in self.allow]

    def secret_values(self, environ: dict[str, str] | None = None) -> list[tuple[str, str, str]]:
        """(host, header, value) of each secret, read from the host's environment now."""
        environ = dict(os.environ) if environ is None else environ
        return [(s.host, s.header, s.value_prefix + environ.get(s.value_env, "")) for s in self.secrets]

    def state_path(self, environ: dict[str, str] | None = None) -> Path:
        if self.state_dir is not None:
            return self.state_dir.expanduser()
        environ = dict(os.environ) if environ is None else environ
        base = Path(environ.get("XDG_STATE_HOME") or Path.home() / ".local" / "state")
        return base / "mcp-code-exec" / "egress"
