"""Names the proxy resolves as the host does: the entries of the host's hosts file, given to its
container as extra hosts (then DNS, as the engine's network gives it)."""

from __future__ import annotations

import ipaddress
from pathlib import Path

LOOPBACK_NAMES = {"localhost", "localhost.localdomain", "ip6-localhost", "ip6-loopback"}
MAX_ENTRIES = 4096


def host_entries(path: Path) -> tuple[tuple[str, str], ...]:
    """(name, address) of each line of a hosts file (blocking). The loopback names are left out:
    the proxy's own loopback is its own, and a name the host maps there is not reachable anyway."""
    try:
        text = path.read_text(errors="replace")
    except OSError:
        return ()
    found: dict[str, str] = {}
    for line in text.splitlines():
        fields = line.split("#", 1)[0].split()
        if len(fields) < 2:
            continue
        try:
            address = ipaddress.ip_address(fields[0].split("%", 1)[0])
        except ValueError:
            continue
        for name in fields[1:]:
            lowered = name.lower()
            if lowered in LOOPBACK_NAMES or lowered.startswith("ip6-") or lowered in found:
                continue
            found[lowered] = str(address)  # the first line naming it wins, as the resolver's does
            if len(found) >= MAX_ENTRIES:
                return tuple(found.items())
    return tuple(found.items())
