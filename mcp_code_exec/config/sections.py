"""The configuration's sections: one pydantic model per table of the file (``[limits]``, ``[pool]``,
``[sessions]``, ``[runs]``, ``[packages]``, ``[[mounts]]``; the faces' own, ``[http]``, ``[files]``, in
``faces``), each closed to unknown keys and checked as it loads, each giving its sizes in bytes too
(the ``_bytes`` properties). ``settings`` assembles them into ``Config``."""

from __future__ import annotations

import os
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationInfo, field_validator
from pydantic_core import PydanticCustomError

from .mounts import NAME_PATTERN, NAME_RULE, MountRefused, host_directory, writable_refusal
from .units import MIB


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

    @property
    def memory_bytes(self) -> int:
        return self.memory_mb * MIB

    @property
    def fsize_bytes(self) -> int:
        return self.fsize_mb * MIB

    @property
    def tmp_bytes(self) -> int:
        return self.tmp_mb * MIB

    @property
    def data_bytes(self) -> int:
        return self.data_mb * MIB

    @property
    def session_data_bytes(self) -> int:
        return self.session_data_mb * MIB

    @property
    def shm_bytes(self) -> int:
        return self.shm_mb * MIB


class PoolSettings(Section):
    size: int = Field(2, ge=1, le=64, description="warm containers for stateless runs")
    session_spares: int = Field(1, ge=0, le=64, description="warm containers waiting to become sessions")
    mode: Literal["recycled", "single-use"] = Field("recycled", description="reuse stateless containers or not")
    lean_interpreter: bool = Field(
        True,
        description="recycled stateless containers keep a second interpreter without the data libraries, for cells"
        " that import only the standard library and IPython: about a quarter less CPU per such run, for about"
        " 10 MiB more per container",
    )
    max_runs_per_container: int = Field(
        500,
        ge=1,
        description="recycled containers are replaced after this many runs (a replacement costs about a second of"
        " CPU: under sustained full load about 2 ms per run at 500, a tenth of that at 5000)",
    )
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
    durable: bool = Field(
        True,
        description="sessions outlive the server: a stop keeps them (files, last snapshot) and the next start "
        "serves them again to the same identity; false: a stop closes them all",
    )
    pause_after_s: float = Field(
        300.0,
        gt=0,
        description="a session unused this long gives its container back (files and snapshot kept) and resumes "
        "at its next call; idle_timeout_s still closes it",
    )
    scope: str = Field(
        "",
        max_length=200,
        description="the servers that share sessions: a start serves again, or removes, only the stopped sessions "
        "of its own scope (those of another are ended only by their lifetime); empty: the address served over "
        "HTTP (http:HOST:PORT), the user over stdio (stdio:UID)",
    )
    max_paused: int = Field(100, ge=0, description="paused sessions kept at once (all clients); they cost disk only")
    max_paused_per_client: int = Field(
        20, ge=0, description="paused sessions one client identity may have at once, forks included"
    )
    snapshot_max_mb: int = Field(
        512, ge=0, description="a session namespace larger than this is not snapshotted (0: no snapshots)"
    )
    history_max_mb: int = Field(
        16, ge=0, description="a session's run history (for export_notebook), oldest outputs dropped first (0: none)"
    )
    snapshot_wait_s: float = Field(
        10.0, gt=0, description="how long a pause, fork or stop waits for a snapshot being written"
    )

    @property
    def snapshot_max_bytes(self) -> int:
        return self.snapshot_max_mb * MIB

    @property
    def history_max_bytes(self) -> int:
        return self.history_max_mb * MIB


class RunSettings(Section):
    """What a finished run leaves on the server and how it is shown: its result, the files of a
    stateless run, and the links to them."""

    keep_s: float = Field(600.0, gt=0, description="how long a finished run's result stays available to get_run")
    max_kept_mb: int = Field(256, ge=1, description="server memory for finished runs' results not yet fetched")
    max_kept_per_client: int = Field(100, ge=1, description="finished runs kept per client identity")
    files_keep_s: float = Field(3600.0, gt=0, description="how long files of stateless runs stay readable")
    files_max_total_mb: int = Field(256, ge=1, description="host memory for files of stateless runs")
    files_max_file_mb: int = Field(10, ge=1, description="largest file kept from a stateless run")
    resource_links: bool = Field(
        False,
        description="add resource_link blocks for files (their URIs are always in the text); some agent "
        "frameworks turn them into file parts that model APIs reject",
    )

    @property
    def max_kept_bytes(self) -> int:
        return self.max_kept_mb * MIB

    @property
    def files_max_total_bytes(self) -> int:
        return self.files_max_total_mb * MIB

    @property
    def files_max_file_bytes(self) -> int:
        return self.files_max_file_mb * MIB


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

    @property
    def max_bytes(self) -> int:
        return self.max_mb * MIB

    @property
    def cache_max_bytes(self) -> int:
        return self.cache_max_mb * MIB

    @field_validator("pip_workers_per_client")
    @classmethod
    def _share_within_pool(cls, value: int, info: ValidationInfo) -> int:
        workers = info.data.get("pip_workers")
        if isinstance(workers, int) and value > workers:
            raise refused(f"{value} is more than pip_workers ({workers})")
        return value

    @field_validator("cache_max_mb")
    @classmethod
    def _cache_holds_an_install(cls, value: int, info: ValidationInfo) -> int:
        most = info.data.get("max_mb")
        if isinstance(most, int) and value < most:
            raise refused(f"{value} is less than max_mb ({most}): the cache must hold one install")
        return value


class HostMount(Section):
    """A host directory the user shares with every sandbox, at /mnt/host/<name> (see mounts.py)."""

    name: str = Field(description="its directory under /mnt/host: a-z, 0-9, _ and -")
    path: Path = Field(description="the host directory (absolute, or under ~); it must exist when the server starts")
    writable: bool = Field(False, description="let sandboxes write there (read-only by default)")

    @field_validator("name")
    @classmethod
    def _short_name(cls, name: str) -> str:
        if not re.fullmatch(NAME_PATTERN, name):
            raise refused(f"{name!r}: a name is {NAME_RULE}")
        return name

    @field_validator("path", mode="before")
    @classmethod
    def _host_directory(cls, value: object, info: ValidationInfo) -> Path:
        if not isinstance(value, str | os.PathLike):
            raise refused("must be a path (a string)")
        context = info.context or {}  # what load_config knows: the environment and the file's own path
        try:
            return host_directory(
                os.fspath(value), environ=context.get("environ", os.environ), config_file=context.get("config_file")
            )
        except MountRefused as exc:
            raise refused(str(exc)) from None

    @field_validator("writable")
    @classmethod
    def _not_the_server(cls, writable: bool, info: ValidationInfo) -> bool:
        path = info.data.get("path")
        why = writable_refusal(path) if writable and isinstance(path, Path) else None
        if why is not None:
            raise refused(why)
        return writable


@dataclass(frozen=True)
class SandboxSettings:
    """What every sandbox container is made of: the file's top-level image, runtime and network, its
    ``[limits]`` and ``[[mounts]]`` (``Config.sandbox`` composes it)."""

    image: str
    runtime: str | None
    network: bool
    limits: Limits
    mounts: tuple[HostMount, ...] = ()
    lean_interpreter: bool = False  # stateless containers fork the lean zygote as well (``[pool]``)


def refused(reason: str) -> PydanticCustomError:
    """A validation error whose message is ``reason`` as it is (no "Value error, " before it)."""
    return PydanticCustomError("host_mount", "{reason}", {"reason": reason})
