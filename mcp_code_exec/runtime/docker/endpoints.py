"""Where a Docker engine may answer, as the docker CLI would look: config, DOCKER_HOST, the current
context, then the usual sockets of Docker Engine, Docker Desktop, colima, OrbStack and Podman; and
the SDK's client for one (blocking: the adapter calls it in a worker thread)."""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path
from typing import Any

import docker
import docker.constants
import docker.tls


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


def make_client(url: str, cert_path: str | None = None) -> docker.DockerClient:
    """A client for ``url`` that has answered a ping; ``cert_path``: its TLS client files."""
    options: dict[str, Any] = {}
    if cert_path is not None:
        files = {name: os.path.join(cert_path, f"{name}.pem") for name in ("ca", "cert", "key")}
        options["tls"] = docker.tls.TLSConfig(
            client_cert=(files["cert"], files["key"]), ca_cert=files["ca"], verify=True
        )
        # requests lets REQUESTS_CA_BUNDLE (or CURL_CA_BUNDLE) replace a session's own CA
        # (psf/requests#5209, docker/docker-py#2433): on a machine that sets it, the engine would
        # be checked against the wrong CA and never answer. This client ignores the environment,
        # so its API version is asked once that is so.
        options["version"] = docker.constants.MINIMUM_DOCKER_API_VERSION
    client = docker.DockerClient(base_url=url, timeout=60, **options)
    try:
        if cert_path is not None:
            client.api.trust_env = False
            client.api._version = client.api._retrieve_server_version()
        client.ping()
    except BaseException:
        client.close()
        raise
    return client
