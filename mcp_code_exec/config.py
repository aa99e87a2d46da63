"""Configuration: defaults, then a TOML file, then the environment (path and secrets), then flags."""

from __future__ import annotations

import os
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, SecretStr, ValidationError, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from .cluster_settings import ClusterSettings
from .errors import ConfigError
from .mounts import MAX_MOUNTS, NAME_PATTERN, NAME_RULE, MountRefused, engine_sockets, host_directory, overlap

ENV_CONFIG = "MCP_CODE_EXEC_CONFIG"
ENV_TOKEN = "MCP_CODE_EXEC_TOKEN"  # noqa: S105 - the variable's name, not a secret
DEFAULT_IMAGE = "mcp-code-exec:latest"
RENAMED = {"limits.max_timeout_s": "limits.max_run_s"}
PACKAGE_DIR = Path(__file__).resolve().parent


class Section(BaseModel):
    model_config = ConfigDict(extra="forbid", frozen=True)


class Limits(Section):
    memory_mb: int = Field(512, ge=64, description="memory (and memory+swap) per container")
    cpus: float = Field(1.0, gt=0, le=64, description="CPU quota per container")
    pids: int = Field(128, ge=16, description="processes and threads per container")
    nofile: int = Field(1024, ge=64, description="open files per process")
    fsize_mb: int = Field(256, ge=1, description="largest single file a run may write")
    tmp_mb: int = Field(256, ge=8, description="size of the /tmp tmpfs")
    data_mb: int = Field(256, ge=8, description="size of /mnt/data for stateless runs (tmpfs)")
    session_data_mb: int = Field(
        1024, ge=8, description="quota of a session's /mnt/data (a volume on the engine's disk; see session_disk)"
    )
    session_max_files: int = Field(10000, ge=10, description="most files and directories in a session's /mnt/data")
    session_disk: Literal["auto", "filesystem", "agent"] = Field(
        "auto",
        description="who enforces a session's quota: 'filesystem' (each session volume is a filesystem of that "
        "size; the server does not start where the engine cannot make one), 'agent' (only the sandbox's own "
        "count, which hidden usage can evade), or 'auto' (filesystem where the engine can, else agent, with a warning)",
    )
    shm_mb: int = Field(64, ge=1, description="size of /dev/shm")
    default_timeout_s: float = Field(30.0, gt=0, description="wall-clock timeout when a call gives none")
    max_run_s: float = Field(3600.0, gt=0, description="largest timeout a run may ask for (it may outlive its call)")
    wait_s: float = Field(
        45.0, gt=0, description="how long run_python waits for a run before answering 'running' (clients time out)"
    )
    max_output_bytes: int = Field(
        65536, ge=1024, description="cap on each of stdout, stderr, the last value's text and display() text"
    )
    max_images: int = Field(20, ge=1, le=1000, description="images (figures, displayed PNGs) returned per run")
    max_displays: int = Field(50, ge=1, le=10000, description="display() outputs returned per run")
    max_code_bytes: int = Field(1024 * 1024, ge=1024, le=32 * 1024 * 1024, description="largest code a run accepts")
    max_image_bytes: int = Field(1_000_000, ge=10_000, description="images above this are downscaled")
    max_image_pixels: int = Field(2_000_000, ge=10_000, description="images above this are downscaled")
    read_max_bytes: int = Field(10 * 1024 * 1024, ge=1024, description="largest file read_file returns")
    write_max_bytes: int = Field(10 * 1024 * 1024, ge=1024, description="largest content write_file accepts")


class PoolSettings(Section):
    size: int = Field(2, ge=1, le=64, description="warm containers for stateless runs")
    session_spares: int = Field(1, ge=0, le=64, description="warm containers waiting to become sessions")
    mode: Literal["recycled", "single-use"] = Field("recycled", description="reuse stateless containers or not")
    max_runs_per_container: int = Field(500, ge=1, description="recycled containers are replaced after this")
    max_size: int = Field(8, ge=1, le=256, description="most stateless containers at once, busy ones included")
    max_runs_per_client: int = Field(
        4, ge=0, description="runs one client identity may have going at once (0: no limit); more wait their turn"
    )
    grow_after_s: float = Field(
        0.5,
        ge=0,
        description="a call that waited this long for a warm container gets a new one started (up to max_size)",
    )
    acquire_timeout_s: float = Field(15.0, gt=0, description="how long a call waits for a container")
    start_timeout_s: float = Field(60.0, gt=0, description="how long a container may take to become ready")


class SessionSettings(Section):
    max_sessions: int = Field(16, ge=1, description="sessions open at once (all clients)")
    max_per_client: int = Field(8, ge=1, description="sessions one client identity may have open at once")
    idle_timeout_s: float = Field(1800.0, gt=0, description="a session unused this long is closed")
    max_lifetime_s: float = Field(86400.0, gt=0, description="a session is closed this long after it opened")


class StatelessFiles(Section):
    keep_s: float = Field(3600.0, gt=0, description="how long files of stateless runs stay readable")
    max_total_mb: int = Field(256, ge=1, description="host memory for files of stateless runs")
    max_file_mb: int = Field(10, ge=1, description="largest file kept from a stateless run")


class RunSettings(Section):
    keep_s: float = Field(600.0, gt=0, description="how long a finished run's result stays available to get_run")
    max_kept_mb: int = Field(256, ge=1, description="server memory for finished runs' results not yet fetched")
    max_kept_per_client: int = Field(100, ge=1, description="finished runs kept per client identity")


class ResultSettings(Section):
    resource_links: bool = Field(
        False,
        description="add resource_link blocks for files (their URIs are always in the text); some agent "
        "frameworks turn them into file parts that model APIs reject",
    )


class PackageSettings(Section):
    enabled: bool = Field(
        True, description="`pip install` in a cell (and run_python's packages) works, offline, from the server's index"
    )
    allow: list[str] = Field(
        default_factory=list, description="the only packages a cell may ask for (names or globs); empty: any"
    )
    deny: list[str] = Field(
        default_factory=list, description="packages never installed, asked for or pulled in (names or globs)"
    )
    max_mb: int = Field(200, ge=1, description="most MiB of wheels one install may bring into a sandbox")
    cache_dir: str | None = Field(
        None, description="where fetched wheels are kept (per architecture); default ~/.cache/mcp-code-exec/wheels"
    )
    cache_max_mb: int = Field(
        2048,
        ge=1,
        description="most MiB of wheels the cache keeps (least recently used go first); also the most one run "
        "of the host's pip may download",
    )
    pip_workers: int = Field(2, ge=1, le=64, description="the host's pip runs at once, for all clients together")
    pip_workers_per_client: int = Field(
        1, ge=1, le=64, description="of those, how many one client identity may have going at once"
    )
    pip_timeout_s: float = Field(120.0, gt=0, description="one run of the host's pip (resolve, look up, download)")
    failed_ttl_s: float = Field(
        300.0, ge=0, description="how long a request pip could not resolve is answered from memory (0: never)"
    )

    @field_validator("pip_workers_per_client")
    @classmethod
    def _share_within_pool(cls, value: int, info: ValidationInfo) -> int:
        workers = info.data.get("pip_workers")
        if isinstance(workers, int) and value > workers:
            raise _refused(f"{value} is more than pip_workers ({workers})")
        return value

    @field_validator("cache_max_mb")
    @classmethod
    def _cache_holds_an_install(cls, value: int, info: ValidationInfo) -> int:
        most = info.data.get("max_mb")
        if isinstance(most, int) and value < most:
            raise _refused(f"{value} is less than max_mb ({most}): the cache must hold one install")
        return value


class HttpSettings(Section):
    token: SecretStr | None = Field(None, description="bearer token (prefer the environment variable)")
    tokens: dict[str, SecretStr] = Field(
        default_factory=dict, description="more bearer tokens, one per client identity: name = token"
    )
    allowed_hosts: list[str] = Field(default_factory=list, description="extra Host values to accept")
    allowed_origins: list[str] = Field(default_factory=list, description="extra Origin values to accept")
    max_body_mb: int = Field(16, ge=1, description="largest request body")
    header_timeout_s: float = Field(10.0, gt=0, description="a connection must send a request's headers within this")
    max_connections: int = Field(2000, ge=16, description="open HTTP connections at once; more are refused")


class HostMount(Section):
    """A host directory the user shares with every sandbox, at /mnt/host/<name> (see mounts.py)."""

    name: str = Field(description="its directory under /mnt/host: a-z, 0-9, _ and -")
    path: Path = Field(description="the host directory (absolute, or under ~); it must exist when the server starts")
    writable: bool = Field(False, description="let sandboxes write there (read-only by default)")

    @field_validator("name")
    @classmethod
    def _short_name(cls, name: str) -> str:
        if not re.fullmatch(NAME_PATTERN, name):
            raise _refused(f"{name!r}: a name is {NAME_RULE}")
        return name

    @field_validator("path", mode="before")
    @classmethod
    def _host_directory(cls, value: object, info: ValidationInfo) -> Path:
        if not isinstance(value, str | os.PathLike):
            raise _refused("must be a path (a string)")
        context = info.context or {}  # what load_config knows: the environment and the file's own path
        try:
            return host_directory(
                os.fspath(value), environ=context.get("environ", os.environ), config_file=context.get("config_file")
            )
        except MountRefused as exc:
            raise _refused(str(exc)) from None

    @field_validator("writable")
    @classmethod
    def _not_the_server(cls, writable: bool, info: ValidationInfo) -> bool:
        path = info.data.get("path")
        if writable and isinstance(path, Path) and overlap(path, PACKAGE_DIR):
            raise _refused(f"{path} holds the server's own code; it cannot be writable")
        return writable


class FileSettings(Section):
    url_ttl_s: float = Field(600.0, gt=0, description="how long a URL from the file_url tool stays valid")
    max_upload_mb: int = Field(
        1024, ge=1, description="largest upload through a URL (the session's quota and limits.fsize_mb apply too)"
    )
    public_base_url: str | None = Field(
        None,
        pattern=r"^https?://[^/?#\s]+(/[^?#\s]*)?$",
        description="what file URLs start with, e.g. https://sandbox.example.com behind a proxy; "
        "default: http:// and the Host the client reached the server by",
    )
    stall_timeout_s: float = Field(
        60.0, gt=0, description="a transfer through a URL that moves no bytes this long ends"
    )


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
    limits: Limits = Field(default_factory=Limits)
    pool: PoolSettings = Field(default_factory=PoolSettings)
    sessions: SessionSettings = Field(default_factory=SessionSettings)
    stateless_files: StatelessFiles = Field(default_factory=StatelessFiles)
    runs: RunSettings = Field(default_factory=RunSettings)
    results: ResultSettings = Field(default_factory=ResultSettings)
    packages: PackageSettings = Field(default_factory=PackageSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    files: FileSettings = Field(default_factory=FileSettings)
    mounts: list[HostMount] = Field(
        default_factory=list, max_length=MAX_MOUNTS, description="host directories shared with sandboxes"
    )

    @field_validator("cluster")
    @classmethod
    def _one_way_to_name_engines(cls, value: ClusterSettings, info: ValidationInfo) -> ClusterSettings:
        if value.engines and info.data.get("docker_host"):
            raise _refused("set docker_host or [cluster] engines, not both (list that engine among the engines)")
        return value

    @field_validator("mounts")
    @classmethod
    def _distinct_mounts(cls, value: list[HostMount], info: ValidationInfo) -> list[HostMount]:
        cluster = info.data.get("cluster")
        engines = cluster.engines if isinstance(cluster, ClusterSettings) else []
        remote = [engine.url for engine in engines if not engine.local]
        if value and remote:
            raise _refused(
                f"host directories can only be shared with engines on this machine; {remote[0]} is not a unix socket"
            )
        # DOCKER_HOST's socket and every engine's: checked with each path
        sockets = engine_sockets([info.data.get("docker_host"), *(engine.url for engine in engines)])
        for index, mount in enumerate(value):
            for other in value[:index]:
                if mount.name == other.name:
                    raise _refused(f"two mounts are named {mount.name!r}")
                if overlap(mount.path, other.path):
                    raise _refused(
                        f"{mount.name!r} ({mount.path}) and {other.name!r} ({other.path}) overlap; "
                        "mount directories that are not inside one another"
                    )
            for socket in sockets:
                if overlap(mount.path, socket.parent):
                    raise _refused(f"{mount.name!r} ({mount.path}) would show the engine's socket {socket}")
        return value


def _refused(reason: str) -> PydanticCustomError:
    """A validation error whose message is ``reason`` as it is (no "Value error, " before it)."""
    return PydanticCustomError("host_mount", "{reason}", {"reason": reason})


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
    if overrides:
        data = _merge(data, overrides)
    try:
        context = {"environ": environ, "config_file": None if path is None else os.path.abspath(path)}
        return Config.model_validate(data, context=context)
    except ValidationError as exc:
        raise ConfigError(_describe(exc, source)) from None
