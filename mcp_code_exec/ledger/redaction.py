"""What an audit line may hold, whoever records it: the identity as its hash (or its name, with
``audit.identities = "named"``), session and run ids as the log lines name them, code only as its
SHA-256 and size (the code itself with ``include_code``), short strings and numbers."""

from __future__ import annotations

import hashlib
from typing import Any

from ..config.accounting import AuditSettings
from ..observability.logs import identity_hash, logged_id

TEXT_MAX = 512  # any string field but the code
SCALARS = (bool, int, float)


def redacted(fields: dict[str, Any], settings: AuditSettings) -> dict[str, Any]:
    """The fields of a line as the log may hold them (see the module's docstring)."""
    out: dict[str, Any] = {}
    for name, value in fields.items():
        if value is None:
            continue
        if name == "identity":
            out[name] = identity_hash(str(value)) if settings.identities == "hashed" else str(value)[:TEXT_MAX]
        elif name in ("session", "run"):
            out[name] = logged_id(str(value))
        elif name == "code":
            data = str(value).encode("utf-8", "surrogatepass")
            out["code_sha256"], out["code_bytes"] = hashlib.sha256(data).hexdigest(), len(data)
            if settings.include_code:
                out["code"] = data.decode("utf-8", "replace")
        elif isinstance(value, str):
            out[name] = value[:TEXT_MAX]
        elif isinstance(value, SCALARS):
            out[name] = value
        elif isinstance(value, dict):
            out[name] = {str(k)[:64]: v for k, v in value.items() if isinstance(v, SCALARS)}
        else:
            out[name] = str(value)[:TEXT_MAX]
    return out
