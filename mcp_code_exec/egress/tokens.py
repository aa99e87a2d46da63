"""Grants as the proxy reads them (``images/egress/egress_policy.read_token``): claims in compact
JSON, base64url, then an HMAC-SHA256 of them under the key this server gave its proxy.

The proxy needs no message to learn a grant, so a run costs the server no round trip; what it
must learn later (a narrowing, an end) goes over the control channel. The token is the password
of the run's ``HTTP_PROXY``: sandbox code can read its own, and copy it anywhere. A grant is
therefore bound to its container: it claims the hash of the container's key (``binding``), which
the container's relay, and only it, sends on every connection to the proxy (the key is never in
sandbox code's reach, see the agent's ``relay``). From any other container the token is refused.
"""

from __future__ import annotations

import base64
import hashlib
import hmac
import json
import secrets
from collections.abc import Iterable

RELAY_PORT = 3128  # where the agent's relay listens, in the sandbox's own loopback
KEY_BYTES = 32


def new_key() -> bytes:
    return secrets.token_bytes(KEY_BYTES)


def b64(data: bytes) -> str:
    return base64.urlsafe_b64encode(data).rstrip(b"=").decode("ascii")


def new_container_key() -> str:
    return secrets.token_hex(KEY_BYTES)


def binding(container_key: str) -> str:
    """What a grant claims of its container's key: a hash, since sandbox code reads its token
    (``images/egress/egress_bridge.binding`` computes the same)."""
    return hashlib.sha256(b"mcp-code-exec egress container\0" + container_key.encode("ascii")).hexdigest()[:32]


def session_hash(session_id: str) -> str:
    """What records and logs show of a session (the id itself lets its owner use it): the same short
    hash every log line of the server shows of a session id ("#" and 12 hex digits)."""
    return "#" + hashlib.sha256(("mcp-code-exec log\0" + session_id).encode("utf-8", "surrogatepass")).hexdigest()[:12]


def session_grant(session_id: str) -> str:
    return "s:" + session_hash(session_id)


def run_grant(run_id: str) -> str:
    return "r:" + run_id


def mint(
    key: bytes, *, grant: str, identity: str, session: str, reach: Iterable[int], expires: float, container: str
) -> str:
    """``container``: the key of the container the grant is for (the token claims its ``binding``)."""
    claims = {
        "g": grant,
        "i": identity,
        "s": session,
        "a": sorted(set(reach)),
        "x": round(expires, 1),
        "c": binding(container),
    }
    body = b64(json.dumps(claims, separators=(",", ":")).encode("ascii"))
    mac = b64(hmac.new(key, body.encode("ascii"), hashlib.sha256).digest())
    return f"{body}.{mac}"


def proxy_url(token: str) -> str:
    """The run's HTTP_PROXY: requests, urllib, httpx, pip, curl and git send the token as Basic
    Proxy-Authorization, on CONNECT and on plain HTTP alike."""
    return f"http://run:{token}@127.0.0.1:{RELAY_PORT}"
