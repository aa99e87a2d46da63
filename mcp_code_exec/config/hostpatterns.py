"""Host patterns of ``[egress] allow``, and host names as the egress proxy compares them.

Standard library only, and one file: the server checks the configuration with it, and the proxy's
image carries a copy of this very file (``commands/image.py`` puts it into the build context), so
the two can never read a pattern differently.

A pattern is a name (``data.example.org``), a wildcard (``*.example.org``: any name below it, not
the name itself) or an IP literal (``10.0.0.5``, ``[2001:db8::1]``), with an optional port;
without one it allows ports 80 and 443. Names compare in their normal form: lower case, no
trailing dot, IDNA (punycode); IPv4-mapped IPv6 addresses are their IPv4 address. An IP literal
matches only an entry of its own, never a name pattern.
"""

from __future__ import annotations

import ipaddress
import re
from dataclasses import dataclass

DEFAULT_PORTS = (80, 443)
IpAddress = ipaddress.IPv4Address | ipaddress.IPv6Address
LABELS = re.compile(r"[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?(\.[a-z0-9_]([a-z0-9_-]{0,61}[a-z0-9_])?)*")
MAX_NAME = 253


def as_ip(host: str) -> IpAddress | None:
    """The address ``host`` writes (brackets allowed), IPv4-mapped IPv6 as IPv4; None for a name."""
    try:
        ip = ipaddress.ip_address(host.strip().removeprefix("[").removesuffix("]"))
    except ValueError:
        return None
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return ip.ipv4_mapped
    return ip


def normalise_host(host: str) -> str | None:
    """``host`` in its normal form (see the module's docstring); None for anything that is no host
    name or address (an empty name, a label too long, a character no name may hold)."""
    text = host.strip()
    ip = as_ip(text)
    if ip is not None:
        return str(ip)
    text = text.rstrip(".").lower()
    if not text or text.startswith("["):
        return None
    try:
        text = text.encode("idna").decode("ascii")
    except UnicodeError:
        return None
    if len(text) > MAX_NAME or not LABELS.fullmatch(text):
        return None
    return text


def header_host(value: str | None) -> str | None:
    """The host a Host header (or an ``authority``) names, normalised: ``name``, ``name:port``,
    ``[v6]`` or ``[v6]:port``; None when it names none."""
    if not value:
        return None
    text = value.strip()
    if text.startswith("["):
        inside, closed, _ = text[1:].partition("]")
        return normalise_host(inside) if closed else None
    if text.count(":") == 1:
        text = text.split(":", 1)[0]
    return normalise_host(text)


@dataclass(frozen=True)
class Pattern:
    text: str  # as configured: what records, metrics and the model see
    host: str  # a normalised name, "*." and one, or an address's text
    ports: tuple[int, ...]
    literal: IpAddress | None  # an IP literal's entry

    def matches(self, host: str, port: int) -> bool:
        """Whether this entry allows ``host`` (normalised) on ``port``."""
        if port not in self.ports:
            return False
        ip = as_ip(host)
        if self.literal is not None:
            return ip == self.literal
        if ip is not None:
            return False  # an address is never reached through a name's entry
        if self.host.startswith("*."):
            return host.endswith(self.host[1:]) and len(host) > len(self.host) - 1
        return host == self.host

    def names(self, host: str) -> bool:
        """Whether this entry allows ``host`` (normalised) on any of its ports."""
        return any(self.matches(host, port) for port in self.ports)


def parse_pattern(text: str) -> Pattern:
    """An entry of ``[egress] allow``; ``ValueError`` saying what is wrong with it."""
    raw = text.strip()
    port_text: str | None = None
    if raw.startswith("["):
        inside, closed, rest = raw[1:].partition("]")
        if not closed or (rest and not rest.startswith(":")):
            raise ValueError(f"{text!r}: an IPv6 address is written [address] or [address]:port")
        host, port_text = inside, rest[1:] if rest else None
    elif raw.count(":") == 1:
        host, port_text = raw.split(":")
    elif ":" in raw:
        raise ValueError(f"{text!r}: write an IPv6 address in brackets, e.g. [2001:db8::1]:443")
    else:
        host = raw
    ports: tuple[int, ...] = DEFAULT_PORTS
    if port_text is not None:
        if not port_text.isdigit() or not 1 <= int(port_text) <= 65535:
            raise ValueError(f"{text!r}: the port must be a number from 1 to 65535")
        ports = (int(port_text),)
    wildcard = host.startswith("*.")
    name = host[2:] if wildcard else host
    if "*" in name:
        raise ValueError(f"{text!r}: a wildcard is only '*.' before a name, e.g. *.example.org")
    normal = normalise_host(name)
    if normal is None:
        raise ValueError(f"{text!r} is not a host name or an IP address")
    literal = as_ip(normal)
    if wildcard and literal is not None:
        raise ValueError(f"{text!r}: a wildcard goes before a name, not an address")
    return Pattern(text=raw, host="*." + normal if wildcard else normal, ports=ports, literal=literal)
