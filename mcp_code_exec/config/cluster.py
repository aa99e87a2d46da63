"""The ``[cluster]`` section: several Docker engines instead of the one found as ``docker_host`` says.

``engines`` lists them, each a URL or a table with a name, a capacity weight and, for ``tcp://``,
its TLS certificates::

    [cluster]
    engines = ["unix:///var/run/docker.sock", {url = "ssh://deploy@host2", capacity = 2}]

Empty (the default): that one engine. Bad URLs are refused when the file is loaded,
with the reason.
"""

from __future__ import annotations

import os
import re
from pathlib import Path
from typing import Any
from urllib.parse import urlsplit

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator, model_validator
from pydantic_core import PydanticCustomError

NAME_RE = r"[a-z0-9][a-z0-9_.-]{0,31}"
TLS_FILES = ("ca.pem", "cert.pem", "key.pem")


def _refused(reason: str) -> PydanticCustomError:
    return PydanticCustomError("engine", "{reason}", {"reason": reason})


def engine_url_problem(url: str) -> str | None:
    """Why ``url`` is no engine address we can use, or None when it is one."""
    try:
        parts = urlsplit(url)
        port = parts.port
    except ValueError as exc:
        return f"{url!r} is not a URL ({exc})"
    if parts.query or parts.fragment:
        return f"{url!r}: an engine URL takes no query or fragment"
    if parts.scheme == "unix":
        if parts.netloc or not parts.path.startswith("/"):
            return f"{url!r}: a unix:// engine needs an absolute socket path, e.g. unix:///var/run/docker.sock"
        return None
    if parts.scheme in ("ssh", "tcp"):
        if not parts.hostname:
            return f"{url!r}: no host name"
        if parts.scheme == "tcp" and parts.path not in ("", "/"):
            return f"{url!r}: a tcp:// engine URL has no path"
        if parts.scheme == "tcp" and port is None:
            return f"{url!r}: a tcp:// engine needs a port, e.g. tcp://host2:2376"
        if parts.scheme == "tcp" and parts.username:
            return f"{url!r}: a tcp:// engine URL has no user"
        return None
    return f"{url!r}: an engine URL starts with unix://, ssh:// or tcp://"


class EngineSettings(BaseModel):
    """One engine of the cluster."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    url: str = Field(
        description="unix:///path/docker.sock, ssh://[user@]host[:port][/remote/docker.sock] or tcp://host:port (TLS)"
    )
    name: str | None = Field(
        None, description="how logs, /healthz, doctor and errors name it (not its URL); default engine-1, engine-2..."
    )
    capacity: float = Field(1.0, gt=0, le=1000, description="its weight: its share of pools and sessions")
    cert_path: Path | None = Field(
        None, description="tcp:// only: a directory with ca.pem, cert.pem and key.pem (the engine is verified)"
    )

    @model_validator(mode="before")
    @classmethod
    def _from_url(cls, data: Any) -> Any:
        return {"url": data} if isinstance(data, str) else data

    @field_validator("url")
    @classmethod
    def _usable_url(cls, url: str) -> str:
        problem = engine_url_problem(url)
        if problem is not None:
            raise _refused(problem)
        return url.rstrip("/") if url.startswith(("ssh://", "tcp://")) else url  # ssh://h/ is ssh://h

    @field_validator("name")
    @classmethod
    def _short_name(cls, name: str | None) -> str | None:
        if name is not None and not re.fullmatch(NAME_RE, name):
            raise _refused(
                f"{name!r}: an engine name is 1 to 32 of a-z, 0-9, _, . and -, starting with a letter or digit"
            )
        return name

    @field_validator("cert_path", mode="before")
    @classmethod
    def _tls_directory(cls, value: Any, info: ValidationInfo) -> Any:
        if value is None:
            return None
        url = str(info.data.get("url", ""))
        if not url.startswith("tcp://"):
            raise _refused("cert_path is for tcp:// engines only (unix:// and ssh:// need none)")
        path = Path(os.path.expanduser(str(value))).resolve()
        missing = [name for name in TLS_FILES if not (path / name).is_file()]
        if missing:
            raise _refused(f"{path} lacks {', '.join(missing)} (the engine's TLS client files)")
        return path

    @model_validator(mode="after")
    def _tls_for_tcp(self) -> EngineSettings:
        if self.url.startswith("tcp://") and self.cert_path is None:
            raise _refused(
                f"{self.url}: a tcp:// engine needs TLS: set cert_path to a directory with ca.pem, cert.pem and "
                "key.pem (an engine API without TLS is root on that host for anyone who reaches the port)"
            )
        return self

    @property
    def local(self) -> bool:
        """On this machine: a unix socket (a host directory means the same thing to it as to us)."""
        return self.url.startswith("unix://")


class ClusterSettings(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)

    engines: list[EngineSettings] = Field(
        default_factory=list, max_length=64, description="several Docker engines; empty: the one engine found"
    )
    health_interval_s: float = Field(2.0, gt=0, le=300, description="seconds between health checks of each engine")
    health_timeout_s: float = Field(5.0, gt=0, le=300, description="an engine that takes longer to answer is out")

    @field_validator("engines")
    @classmethod
    def _named_and_distinct(cls, engines: list[EngineSettings]) -> list[EngineSettings]:
        named = [
            engine if engine.name else engine.model_copy(update={"name": f"engine-{index + 1}"})
            for index, engine in enumerate(engines)
        ]
        for index, engine in enumerate(named):
            for other in named[:index]:
                if engine.url == other.url:
                    raise _refused(f"{engine.url} is listed twice")
                if engine.name == other.name:
                    raise _refused(f"two engines are named {engine.name!r}")
        return named
