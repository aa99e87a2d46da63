"""The egress proxy's decisions, without mitmproxy: grants, reach, addresses, budgets, records.

Standard library only (and ``hostpatterns``, the server's own module), so the unit tier checks
every decision here on the host; ``egress_addon`` applies them in mitmproxy's hooks.

A grant is a token the server minted (``mcp_code_exec.egress.tokens``): its claims (the grant's
id, the identity's hash, the session's hash, the indices of the ``allow`` entries it may reach,
when it expires, the binding of the container it was issued to) and an HMAC of them under a key
only the server and this proxy hold. The proxy needs no message per run to know a grant: a run
costs the server no round trip. What changes a grant after it was minted comes over the control
channel: a session narrowed (``narrow``), a run or session ended (``end``: its connections are cut
and its token refused), a session's next run (``run``: its run budget starts again).
"""

from __future__ import annotations

import base64
import binascii
import hashlib
import hmac
import ipaddress
import json
import time
from dataclasses import dataclass, field
from typing import Any

from hostpatterns import IpAddress, Pattern, as_ip, normalise_host, parse_pattern

MiB = 1 << 20
SETTING_ALLOW = "[egress] allow"
Network = ipaddress.IPv4Network | ipaddress.IPv6Network


class Refused(Exception):
    """A request the policy refuses: ``status`` (403 or 407) and the reason the sandbox reads."""

    def __init__(self, status: int, reason: str) -> None:
        super().__init__(reason)
        self.status = status
        self.reason = reason


@dataclass(frozen=True)
class Claims:
    grant: str  # "s:<hash>" for a session, "r:<run id>" for a stateless run
    identity: str  # the identity's hash (as the server's logs and records show it)
    session: str  # the session's hash, "" for a stateless run
    reach: frozenset[int]  # indices into the configured allow entries
    expires: float  # epoch seconds
    container: str = ""  # the binding of its container's key (``egress_bridge.binding``)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def unb64(text: str) -> bytes:
    return base64.urlsafe_b64decode(text + "=" * (-len(text) % 4))


def sign(key: bytes, body: str) -> str:
    return b64(hmac.new(key, body.encode("ascii"), hashlib.sha256).digest())


def read_token(key: bytes, token: str) -> Claims | None:
    """The claims of a token this proxy's server minted, or None (forged, altered, malformed)."""
    body, dot, mac = token.partition(".")
    if not dot or len(token) > 4096 or not hmac.compare_digest(sign(key, body), mac):
        return None
    try:
        data = json.loads(unb64(body))
        reach = frozenset(int(index) for index in data["a"])
        return Claims(str(data["g"]), str(data["i"]), str(data.get("s", "")), reach, float(data["x"]), str(data["c"]))
    except (ValueError, KeyError, TypeError, binascii.Error):
        return None


def proxy_token(value: str | None) -> str | None:
    """The token of a Proxy-Authorization header (Basic, any user name, the token as password)."""
    if not value:
        return None
    scheme, _, encoded = value.strip().partition(" ")
    if scheme.lower() != "basic":
        return None
    try:
        text = base64.b64decode(encoded.strip(), validate=True).decode("ascii")
    except (binascii.Error, UnicodeDecodeError):
        return None
    return text.partition(":")[2] or None


@dataclass
class Policy:
    """The configuration the server sent (``config``), as the proxy uses it."""

    patterns: list[Pattern] = field(default_factory=list)
    private: list[Network] = field(default_factory=list)
    secrets: dict[str, list[tuple[str, str]]] = field(default_factory=dict)  # host -> (header, value)
    budget_run: int | None = None
    budget_day: int | None = None

    @classmethod
    def from_message(cls, message: dict[str, Any]) -> Policy:
        secrets: dict[str, list[tuple[str, str]]] = {}
        for item in message.get("secrets", []):
            host = normalise_host(str(item["host"]))
            if host is None:
                raise ValueError(f"not a host: {item['host']!r}")
            secrets.setdefault(host, []).append((str(item["header"]), str(item["value"])))
        return cls(
            patterns=[parse_pattern(str(text)) for text in message.get("allow", [])],
            private=[ipaddress.ip_network(str(text)) for text in message.get("private_ranges", [])],
            secrets=secrets,
            budget_run=_positive(message.get("budget_run")),
            budget_day=_positive(message.get("budget_day")),
        )

    def intercepted(self) -> list[str]:
        """mitmproxy's ``allow_hosts``: the secret hosts alone are intercepted. Never empty: an empty
        list would intercept every host, so with no secret it is a pattern that matches nothing."""
        return [_host_regex(host) for host in self.secrets] or ["(?!)"]

    def secrets_for(self, host: str, port: int, *, tls: bool) -> list[tuple[str, str]]:
        """The headers to set on a request to ``host`` (normalised). In plain text, never to port 443:
        a sandbox may speak plain HTTP inside a CONNECT tunnel or write ``http://host:443/``, and the
        header would cross the network in clear text to a port its operator took for TLS."""
        found = self.secrets.get(host, [])
        if found and not tls and port == 443:
            raise Refused(
                403,
                f"a plain-text request to {host!r} port 443: the header the proxy adds for this host goes "
                "to port 443 over TLS only",
            )
        return found

    def address_ok(self, ip: IpAddress) -> bool:
        inner = embedded_ipv4(ip)
        if inner is not None and not self.address_ok(inner):
            return False  # a translator or tunnel would take the connection to that IPv4 address
        return ip.is_global or any(ip.version == net.version and ip in net for net in self.private)

    def choose(self, host: str, addresses: list[str], pattern: Pattern) -> str:
        """The address to connect to: an IP literal's own entry, else the first address the name
        resolved to that is global or in ``private_ranges``. ``Refused`` naming what it found."""
        if pattern.literal is not None:
            return str(pattern.literal)
        found = [ip for ip in (as_ip(text) for text in addresses) if ip is not None]
        for ip in found:
            if self.address_ok(ip):
                return str(ip)
        listed = ", ".join(sorted({str(ip) for ip in found})) or "no address"
        raise Refused(
            403,
            f"{host!r} resolves to {listed}, which is not a public address; "
            "an internal service's range must be listed in [egress] private_ranges",
        )


NAT64 = ipaddress.IPv6Network("64:ff9b::/96")  # RFC 6052's well-known prefix: global to ipaddress
IPV4_COMPATIBLE = ipaddress.IPv6Network("::/96")


def embedded_ipv4(ip: IpAddress) -> ipaddress.IPv4Address | None:
    """The IPv4 address an IPv6 one leads to through a translator or a tunnel (NAT64, IPv4-compatible,
    6to4, Teredo's client), which ``is_global`` does not look at: 64:ff9b::a9fe:a9fe is the
    metadata address wherever the network has NAT64."""
    if not isinstance(ip, ipaddress.IPv6Address):
        return None
    if ip in NAT64 or ip in IPV4_COMPATIBLE:
        return ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)
    if ip.sixtofour is not None:
        return ip.sixtofour
    return ip.teredo[1] if ip.teredo is not None else None


def _positive(value: Any) -> int | None:
    return int(value) if isinstance(value, int | float) and value > 0 else None


def _host_regex(host: str) -> str:
    import re

    return "^" + re.escape(host) + r"(:\d+)?$"


def utc_day(now: float) -> str:
    return time.strftime("%Y-%m-%d", time.gmtime(now))


@dataclass
class Grants:
    """What the proxy knows of grants beyond their tokens: narrowings, ends, bytes used."""

    key: bytes
    narrowed: dict[str, frozenset[int]] = field(default_factory=dict)
    ended: dict[str, float] = field(default_factory=dict)  # grant -> when its token expires anyway
    run_used: dict[str, int] = field(default_factory=dict)  # grant -> bytes since its run began
    day: str = ""
    day_used: dict[str, int] = field(default_factory=dict)  # identity hash -> bytes this UTC day

    def claims(self, header: str | None, now: float, container: str | None) -> Claims:
        """The grant of a request's Proxy-Authorization, coming from ``container`` (the binding of the
        key its relay sent); ``Refused`` (407) for none that is valid there."""
        token = proxy_token(header)
        claims = None if token is None else read_token(self.key, token)
        if claims is None:
            raise Refused(407, "no valid egress credentials (the HTTP_PROXY this sandbox was given)")
        if container is None or not hmac.compare_digest(claims.container, container):
            raise Refused(
                407, "these egress credentials were issued to another sandbox (a grant works only where it was given)"
            )
        if claims.grant in self.ended or claims.expires < now:
            raise Refused(407, "these egress credentials are of a run or session that has ended")
        return claims

    def reach(self, claims: Claims) -> frozenset[int]:
        narrowed = self.narrowed.get(claims.grant)
        return claims.reach if narrowed is None else claims.reach & narrowed

    def match(self, policy: Policy, claims: Claims, host: str, port: int) -> Pattern:
        """The allow entry that lets this grant reach ``host`` on ``port``; ``Refused`` otherwise."""
        reach = self.reach(claims)
        for index, pattern in enumerate(policy.patterns):
            if pattern.matches(host, port):
                if index in reach:
                    return pattern
                raise Refused(
                    403,
                    f"host {host!r} (port {port}) is allowed by {SETTING_ALLOW} entry {pattern.text!r}, but not "
                    "for this session: its principals, or a narrowing of the session's egress, leave it out",
                )
        raise Refused(
            403,
            f"host {host!r} (port {port}) is not allowed; the hosts sandboxes may reach are "
            f"{SETTING_ALLOW} in the server's configuration",
        )

    def narrow(self, grant: str, reach: frozenset[int]) -> None:
        """Never wider: a second narrowing keeps what both allow."""
        self.narrowed[grant] = self.narrowed.get(grant, reach) & reach

    def new_run(self, grant: str) -> None:
        self.run_used.pop(grant, None)

    def end(self, grant: str, expires: float) -> None:
        self.ended[grant] = expires
        self.run_used.pop(grant, None)
        self.narrowed.pop(grant, None)

    def prune(self, now: float) -> None:
        """Forget ended grants past their tokens' expiry (their tokens are refused by it anyway)."""
        for grant in [grant for grant, expires in self.ended.items() if expires < now]:
            del self.ended[grant]

    def roll(self, now: float) -> None:
        today = utc_day(now)
        if today != self.day:
            self.day, self.day_used = today, {}

    def budget_error(self, policy: Policy, claims: Claims, now: float) -> str | None:
        self.roll(now)
        used = self.run_used.get(claims.grant, 0)
        if policy.budget_run is not None and used >= policy.budget_run:
            return (
                f"this run used its egress budget ({used} of {policy.budget_run} bytes; "
                "[egress] budget_run_mb in the server's configuration)"
            )
        used = self.day_used.get(claims.identity, 0)
        if policy.budget_day is not None and used >= policy.budget_day:
            return (
                f"this identity used its egress budget for today ({used} of {policy.budget_day} bytes, "
                "until 00:00 UTC; [egress] budget_day_mb in the server's configuration)"
            )
        return None

    def count(self, policy: Policy, claims: Claims, nbytes: int, now: float) -> str | None:
        """Count bytes moved for a grant; the budget it went past, if any (the caller cuts)."""
        self.roll(now)
        self.run_used[claims.grant] = self.run_used.get(claims.grant, 0) + nbytes
        self.day_used[claims.identity] = self.day_used.get(claims.identity, 0) + nbytes
        return self.budget_error(policy, claims, now)

    def restore_day(self, day: str, used: dict[str, int]) -> None:
        """The day's counters the server kept (a restarted proxy starts from them)."""
        if day == self.day or not self.day:
            self.day = day
            for identity, count in used.items():
                self.day_used[identity] = max(self.day_used.get(identity, 0), int(count))


def record(
    decision: str,
    claims: Claims | None,
    *,
    host: str,
    method: str,
    pattern: Pattern | None = None,
    status: int | None = None,
    up: int = 0,
    down: int = 0,
    reason: str | None = None,
    intercepted: bool = False,
) -> dict[str, Any]:
    """An access record for the server: never a path, a query, a header or a body."""
    return {
        "ev": "access",
        "decision": decision,
        "identity": claims.identity if claims else None,
        "session": claims.session if claims else None,
        "grant": claims.grant if claims else None,
        "pattern": pattern.text if pattern else None,
        "host": host[:255],
        "method": method[:16],
        "status": status,
        "up": up,
        "down": down,
        "reason": reason,
        "intercepted": intercepted,
    }
