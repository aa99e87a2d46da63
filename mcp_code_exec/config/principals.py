"""Who a ``principals`` list names: the one reading of it for code mode's servers and egress's hosts.

An entry is a bearer token's name (``alice``: the identity ``token:alice`` of ``[http.tokens]``),
a whole identity (``token:alice``, ``user:ann`` for a stdio client of the OS user ann,
``local:desktop`` for one with ``[stdio] identity = "desktop"``), or the word ``local``: every
stdio client, whatever its name. No list (None) names everyone.
"""

from __future__ import annotations

from collections.abc import Sequence

STDIO_PREFIXES = ("user:", "local:")
LOCAL = "local"  # every stdio client (and a server built in memory, whose identity is "local")


def is_local(identity: str) -> bool:
    """Whether ``identity`` is a stdio client's (or the in-memory server's)."""
    return identity == LOCAL or identity.startswith(STDIO_PREFIXES)


def principal_matches(identity: str, principals: Sequence[str] | None) -> bool:
    """Whether any entry names ``identity``: ``alice`` is the bearer token named alice (``token:alice``);
    ``local`` is every stdio client; an entry with a kind (``local:NAME``, ``user:NAME``,
    ``token:NAME``) is that identity alone."""
    if principals is None:
        return True
    return any(_entry_matches(identity, name) for name in principals)


def _entry_matches(identity: str, principal: str) -> bool:
    if principal == LOCAL:
        return is_local(identity)
    if ":" in principal:
        return identity == principal
    return identity == f"token:{principal}"
