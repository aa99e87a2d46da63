"""Where a Docker engine may answer, as the docker CLI would look: config, DOCKER_HOST, the current
context, then the usual sockets of Docker Engine, Docker Desktop, colima, OrbStack and Podman."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def candidate_endpoints(explicit: str | None, environ: dict[str, str] | None = None) -> list[str]:
    """Where an engine may answer, in the order tried: config, DOCKER_HOST, context, sockets."""
    env = dict(os.environ if environ is None else environ)
    found: list[str] = []
    # An endpoint the user named is the only one tried, as with the docker CLI.
    if explicit:
        return [explicit]
    if env.get("DOCKER_HOST"):
        return [env["DOCKER_HOST"]]
    context_host = _context_endpoint(env)
    if context_host:
        found.append(context_host)
    home = Path(env.get("HOME", str(Path.home())))
    runtime_dir = env.get("XDG_RUNTIME_DIR", f"/run/user/{os.getuid()}")
    for path in (
        "/var/run/docker.sock",
        str(home / ".docker/run/docker.sock"),
        str(home / ".docker/desktop/docker.sock"),
        f"{runtime_dir}/docker.sock",
        str(home / ".colima/default/docker.sock"),
        str(home / ".orbstack/run/docker.sock"),
        f"{runtime_dir}/podman/podman.sock",
    ):
        url = f"unix://{path}"
        if url not in found and os.path.exists(path):
            found.append(url)
    return found or ["unix:///var/run/docker.sock"]


def _context_endpoint(env: dict[str, str]) -> str | None:
    config_dir = Path(env.get("DOCKER_CONFIG", str(Path(env.get("HOME", str(Path.home()))) / ".docker")))
    try:
        name = env.get("DOCKER_CONTEXT") or json.loads((config_dir / "config.json").read_text()).get("currentContext")
        if not name or name == "default":
            return None
        digest = hashlib.sha256(name.encode()).hexdigest()
        meta = json.loads((config_dir / "contexts" / "meta" / digest / "meta.json").read_text())
        host = meta["Endpoints"]["docker"]["Host"]
        return str(host) if host else None
    except (OSError, ValueError, KeyError, TypeError):
        return None
