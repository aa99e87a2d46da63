"""Configuration: defaults, then a TOML file, then the environment (path and secrets), then flags."""

from __future__ import annotations

import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import Field, ValidationError, ValidationInfo, field_validator

from ..errors import ConfigError
from .accounting import ENV_AUDIT_KEY, AuditSettings, QuotaSettings
from .cluster import ClusterSettings
from .code_mode import CodeModeSettings, upstream_refusal
from .egress import EgressSettings
from .faces import FileSettings, HttpSettings, MetricsSettings, StdioSettings
from .mounts import MAX_MOUNTS, cache_refusal, engine_sockets, overlap, socket_place, wheel_cache
from .moved import RENAMED, move_old_sections
from .sections import (
    HostMount,
    Limits,
    PackageSettings,
    PoolSettings,
    RunSettings,
    SandboxSettings,
    Section,
    SessionSettings,
    refused,
)

ENV_CONFIG = "MCP_CODE_EXEC_CONFIG"
ENV_TOKEN = "MCP_CODE_EXEC_TOKEN"  # noqa: S105 - the variable's name, not a secret
ENV_OAUTH_SECRET = "MCP_CODE_EXEC_OAUTH_CLIENT_SECRET"  # noqa: S105 - likewise
DEFAULT_IMAGE = "mcp-code-exec:latest"


class Config(Section):
    image: str = Field(DEFAULT_IMAGE, description="sandbox image to run")
    runtime: str | None = Field(None, description='container runtime, e.g. "runsc" for gVisor')
    network: bool = Field(False, description="give containers a network (off by default)")
    docker_host: str | None = Field(None, description="engine endpoint; default: DOCKER_HOST, context, sockets")
    engine_wait_s: float = Field(
        0.0, ge=0, description="at start, keep trying this long for the engine (e.g. while Docker Desktop starts)"
    )
    cluster: ClusterSettings = Field(default_factory=ClusterSettings, description="several engines (see [cluster])")
    log_level: Literal["debug", "info", "warning", "error"] = "info"
    log_format: Literal["text", "json"] = Field(
        "text", description="log lines on stderr: text, or one JSON object a line"
    )
    limits: Limits = Field(default_factory=Limits)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    runs: RunSettings = Field(default_factory=RunSettings)
    packages: PackageSettings = Field(default_factory=PackageSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    stdio: StdioSettings = Field(default_factory=StdioSettings)
    files: FileSettings = Field(default_factory=FileSettings)
    code_mode: CodeModeSettings = Field(
        default_factory=CodeModeSettings, description="upstream MCP servers sandbox code may call (see [code_mode])"
    )
    egress: EgressSettings = Field(
        default_factory=EgressSettings, description="hosts sandboxes may reach through the server's proxy"
    )
    metrics: MetricsSettings = Field(default_factory=MetricsSettings)
    quotas: QuotaSettings = Field(default_factory=QuotaSettings, description="per identity (see [quotas])")
    audit: AuditSettings = Field(default_factory=AuditSettings, description="the audit log (see [audit])")
    mounts: list[HostMount] = Field(
        default_factory=list, max_length=MAX_MOUNTS, description="host directories shared with sandboxes"
    )

    @property
    def sandbox(self) -> SandboxSettings:
        """What the sandbox layer reads to make a container."""
        return SandboxSettings(
            self.image,
            self.runtime,
            self.network,
            self.limits,
            tuple(self.mounts),
            # a single-use container runs one cell, in the worker it forked before it knew the cell's kind
            lean_interpreter=self.pool.lean_interpreter and self.pool.mode == "recycled",
        )

    @field_validator("cluster")
    @classmethod
    def _one_way_to_name_engines(cls, value: ClusterSettings, info: ValidationInfo) -> ClusterSettings:
        if value.engines and info.data.get("docker_host"):
            raise refused("set docker_host or [cluster] engines, not both (list that engine among the engines)")
        return value

    @field_validator("egress")
    @classmethod
    def _egress_or_network(cls, value: EgressSettings, info: ValidationInfo) -> EgressSettings:
        if not value.enabled:
            return value
        if info.data.get("network"):
            raise refused(
                "network = true gives sandboxes the whole network, which [egress] would only pretend to limit: "
                "set network = false to use [egress] allow, or remove [egress] allow"
            )
        cluster = info.data.get("cluster")
        if isinstance(cluster, ClusterSettings) and cluster.engines:
            raise refused("[egress] runs its proxy beside one engine; it does not work with [cluster] engines yet")
        return value

    @field_validator("quotas")
    @classmethod
    def _room_for_a_session(cls, value: QuotaSettings, info: ValidationInfo) -> QuotaSettings:
        limits = info.data.get("limits")
        if isinstance(limits, Limits) and value.default.stored_mb < limits.session_data_mb:
            raise refused(
                f"default.stored_mb ({value.default.stored_mb}) is less than limits.session_data_mb "
                f"({limits.session_data_mb}): no session would fit"
            )
        return value

    @field_validator("mounts")
    @classmethod
    def _distinct_mounts(cls, value: list[HostMount], info: ValidationInfo) -> list[HostMount]:
        cluster = info.data.get("cluster")
        engines = cluster.engines if isinstance(cluster, ClusterSettings) else []
        remote = [engine.url for engine in engines if not engine.local]
        if value and remote:
            raise refused(
                f"host directories can only be shared with engines on this machine; {remote[0]} is not a unix socket"
            )
        # DOCKER_HOST's socket and every engine's: checked with each path
        sockets = engine_sockets([info.data.get("docker_host"), *(engine.url for engine in engines)])
        packages = info.data.get("packages")
        configured = packages.cache_dir if isinstance(packages, PackageSettings) else None
        cache = wheel_cache(configured, (info.context or {}).get("environ", os.environ))
        for index, mount in enumerate(value):
            for other in value[:index]:
                if mount.name == other.name:
                    raise refused(f"two mounts are named {mount.name!r}")
                if overlap(mount.path, other.path):
                    raise refused(
                        f"{mount.name!r} ({mount.path}) and {other.name!r} ({other.path}) overlap; "
                        "mount directories that are not inside one another"
                    )
            why = cache_refusal(mount.path, cache) if mount.writable else None
            if why is not None:
                raise refused(f"{mount.name!r}: {why}")
            for socket in sockets:
                if overlap(mount.path, socket_place(socket)):
                    raise refused(f"{mount.name!r} ({mount.path}) would show the engine's socket {socket}")
        return value

    @field_validator("mounts")
    @classmethod
    def _no_upstream_runs_from_a_writable_mount(cls, value: list[HostMount], info: ValidationInfo) -> list[HostMount]:
        code_mode = info.data.get("code_mode")
        if isinstance(code_mode, CodeModeSettings):
            environ = (info.context or {}).get("environ", os.environ)
            why = upstream_refusal(code_mode, (mount.path for mount in value if mount.writable), environ)
            if why is not None:
                raise refused(why)
        return value


def _describe(exc: ValidationError, source: str) -> str:
    first = exc.errors()[0]
    key = "".join(f"[{part}]" if isinstance(part, int) else f".{part}" for part in first["loc"]).lstrip(".")
    key = key or "(top level)"
    message = "unknown key" if first["type"] == "extra_forbidden" else first["msg"]
    if key in RENAMED:
        message = f"renamed to {RENAMED[key]}"
    more = f" (and {exc.error_count() - 1} more)" if exc.error_count() > 1 else ""
    return f"{source}: {key}: {message}{more}"


def _merge(base: dict[str, Any], override: Mapping[str, Any]) -> dict[str, Any]:
    merged = dict(base)
    for key, value in override.items():
        if isinstance(value, Mapping) and isinstance(merged.get(key), dict):
            merged[key] = _merge(merged[key], value)
        else:
            merged[key] = value
    return merged


def load_config(
    path: str | Path | None = None,
    *,
    environ: Mapping[str, str] | None = None,
    overrides: Mapping[str, Any] | None = None,
) -> Config:
    """Build the configuration. Raises ``ConfigError`` naming the key and the problem."""
    environ = os.environ if environ is None else environ
    data: dict[str, Any] = {}
    source = "configuration"
    path = path or environ.get(ENV_CONFIG) or None
    if path is not None:
        source = str(path)
        try:
            with open(path, "rb") as handle:
                data = tomllib.load(handle)
        except FileNotFoundError:
            raise ConfigError(f"{source}: config file not found") from None
        except OSError as exc:
            raise ConfigError(f"{source}: cannot read the config file ({exc.strerror})") from None
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"{source}: not valid TOML ({exc})") from None
    if environ.get(ENV_TOKEN):
        data = _merge(data, {"http": {"token": environ[ENV_TOKEN]}})
    if environ.get(ENV_AUDIT_KEY):
        data = _merge(data, {"audit": {"key": environ[ENV_AUDIT_KEY]}})
    oauth = data.get("http", {}).get("oauth") if isinstance(data.get("http"), dict) else None
    if environ.get(ENV_OAUTH_SECRET) and isinstance(oauth, dict):  # only into a section the file has
        data = _merge(data, {"http": {"oauth": {"introspection_client_secret": environ[ENV_OAUTH_SECRET]}}})
    if overrides:
        data = _merge(data, overrides)
    data = move_old_sections(data, source)
    try:
        context = {"environ": environ, "config_file": None if path is None else os.path.abspath(path)}
        return Config.model_validate(data, context=context)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None
