"""Packages for sandboxes that have no network: resolved and fetched on the host, copied in.

Before a cell runs, ``plan`` reads what its ``pip install`` lines ask for (``requirements``),
holds it to the ``[packages]`` policy, resolves it with the host's own pip against the image's lock
(so nothing already in the image moves, and what is already there is not fetched again), and
fetches the wheels, hash-checked, into a cache shared by every sandbox (``wheels``): a package a
sandbox installed once is not downloaded again, and the same request is not even resolved again
for a while. ``ship`` then puts the wheels into the sandbox's ``/mnt/data/.wheelhouse``, where the
sandbox's own ``pip`` (offline, ``--no-index``) installs them into the session's site directory
``/mnt/data/.packages`` (see ``mcpx_agent/worker/packages.py``); the wheelhouse goes after the cell.
Only wheels: pip runs with ``--only-binary=:all:``, so nothing is built or run on the host.
"""

from __future__ import annotations

import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass
from pathlib import Path

import anyio
import anyio.to_thread

from ...config.settings import PackageSettings
from ...errors import FileOperationError, PackageError
from ...models import ErrorInfo
from ...sandbox.container import Sandbox
from ...sandbox.image import context_dir
from ...sandbox.transfer import file_chunks, upload
from . import wheels
from .requirements import PackageRequest, check_denied, check_requested, prescan

log = logging.getLogger(__name__)
MIB = 1024 * 1024
WHEELHOUSE = ".wheelhouse"  # under /mnt/data (the agent's packages.WHEELHOUSE)
RESOLUTIONS_KEPT = 256
RESOLUTION_TTL_S = 3600.0  # the index may publish new versions; a resolution is reused this long


@dataclass(frozen=True)
class Plan:
    """What one run installs: the request, and the wheels to copy in (those the image lacks)."""

    request: PackageRequest
    wheels: tuple[Path, ...]
    size: int


@dataclass
class PackageStats:
    """Counters, for logs and tests: what was resolved, fetched and shipped, and what came cached."""

    resolutions: int = 0  # pip resolver runs
    resolution_hits: int = 0  # requests answered from the in-memory resolution cache
    downloaded: int = 0  # wheels fetched from the index
    cached: int = 0  # wheels found in the disk cache
    shipped: int = 0  # wheels copied into sandboxes


class Packages:
    def __init__(
        self, settings: PackageSettings, engine_arch: Callable[[], Awaitable[str]], lock: Path | None = None
    ) -> None:
        self.settings = settings
        self.stats = PackageStats()
        self._engine_arch = engine_arch
        self._arch: str | None = None
        self._lock_path = lock or context_dir() / "requirements.lock"
        self._lock: dict[str, wheels.Pin] | None = None
        self._resolved: dict[tuple[object, ...], tuple[float, tuple[wheels.Pin, ...]]] = {}
        self._fetching = threading.Lock()  # one pip download into the cache at a time (threads may be abandoned)

    async def prepare(
        self,
        sandbox: Sandbox,
        code: str,
        extra: Sequence[str],
        *,
        timeout_s: float,
        quota_bytes: int | None = None,
        quota_files: int | None = None,
    ) -> ErrorInfo | None:
        """Copy in what the cell's pip lines and ``extra`` need, within the run's own timeout; when
        refused, the run's error."""
        try:
            with anyio.fail_after(timeout_s):
                plan = await self.plan(code, extra)
                if plan is not None:
                    self.stats.shipped += await ship(sandbox, plan, quota_bytes=quota_bytes, quota_files=quota_files)
        except TimeoutError:
            message = f"getting the packages took longer than the run's timeout ({timeout_s:g} s); give it more time"
            return ErrorInfo(type="PackageError", message=f"{message}. Nothing of the cell was run.")
        except PackageError as exc:
            return ErrorInfo(type="PackageError", message=f"{exc}. Nothing of the cell was run.")
        return None

    async def plan(self, code: str, extra: Sequence[str] = ()) -> Plan | None:
        """The wheels ``code``'s pip lines (and ``extra``) need, fetched; None when it installs nothing.
        PackageError, with a sentence for the model, when the request is refused or cannot be served."""
        request = prescan(code, extra)
        if request is None:
            return None
        check_requested(request.names, self.settings)
        arch = await self.arch()
        pins = await self._resolve(request, arch)
        check_denied((pin.name for pin in pins), self.settings, wanted_by=", ".join(request.names))
        found, downloaded = await anyio.to_thread.run_sync(self._fetch, pins, arch, abandon_on_cancel=True)
        self.stats.downloaded += downloaded
        self.stats.cached += len(pins) - downloaded
        sizes = {path: size for path, size in found}
        total = sum(sizes.values())
        if total > self.settings.max_mb * MIB:
            raise PackageError(
                f"{', '.join(request.names)} would bring {total / MIB:.0f} MiB of wheels; this server allows "
                f"{self.settings.max_mb} MiB per install ([packages] max_mb)"
            )
        return Plan(request, tuple(sizes), total)

    async def arch(self) -> str:
        if self._arch is None:
            try:
                self._arch = wheels.sandbox_arch(await self._engine_arch())
            except wheels.WheelError as exc:
                raise PackageError(str(exc)) from None
        return self._arch

    async def _resolve(self, request: PackageRequest, arch: str) -> tuple[wheels.Pin, ...]:
        key = (arch, *request.key)
        now = time.monotonic()
        hit = self._resolved.get(key)
        if hit is not None and now - hit[0] < RESOLUTION_TTL_S:
            self.stats.resolution_hits += 1
            log.info("packages %s: resolution cached (%d wheels)", " ".join(request.requirements)[:200], len(hit[1]))
            return hit[1]
        pins = await anyio.to_thread.run_sync(self._resolve_blocking, request, arch, abandon_on_cancel=True)
        self.stats.resolutions += 1
        log.info(
            "packages %s: resolved in %.0f ms (%d wheels to ship)",
            " ".join(request.requirements)[:200],
            (time.monotonic() - now) * 1000,
            len(pins),
        )
        self._resolved[key] = (now, pins)
        while len(self._resolved) > RESOLUTIONS_KEPT:
            self._resolved.pop(next(iter(self._resolved)))
        return pins

    def _resolve_blocking(self, request: PackageRequest, arch: str) -> tuple[wheels.Pin, ...]:
        lock = self.image_lock()
        try:
            pins = wheels.resolve(request.requirements, arch, constraints=lock, pre=request.pre)
        except wheels.NoDistribution as exc:
            raise PackageError(missing(exc.requirement, arch)) from None
        except wheels.WheelError as exc:
            raise PackageError(str(exc)) from None
        # What the image has at that version is there already (the lock constrains the rest).
        return tuple(pin for pin in pins if pin.name not in lock or lock[pin.name].version != pin.version)

    def _fetch(self, pins: Sequence[wheels.Pin], arch: str) -> tuple[list[tuple[Path, int]], int]:
        cache = wheels.cache_root(self.settings.cache_dir) / arch
        with self._fetching:
            downloaded = sum(1 for pin in pins if not cache.is_dir() or wheels.find_wheel(cache, pin) is None)
            try:
                found = wheels.fetch(pins, arch, cache)
            except wheels.WheelError as exc:
                raise PackageError(str(exc)) from None
        return [(path, path.stat().st_size) for path in found], downloaded

    def image_lock(self) -> dict[str, wheels.Pin]:
        if self._lock is None:
            self._lock = wheels.read_lock(self._lock_path.read_text())
        return self._lock


def missing(requirement: str, arch: str) -> str:
    """Why pip found nothing for ``requirement``: no such project, or none of it the sandbox can use."""
    name = wheels.normalize(re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0])
    versions = wheels.index_versions(name)
    if versions is None:
        return f"no such package on the server's index: {name} (check the name)"
    shown = ", ".join(versions[:8]) + (", ..." if len(versions) > 8 else "")
    return (
        f"no wheel of {requirement} for the sandbox (CPython {wheels.SANDBOX_PYTHON}, Linux {arch}): the index has "
        f"{name} ({shown}), but only as source or for other platforms, or not at that version; source "
        "packages are never built here"
    )


async def ship(sandbox: Sandbox, plan: Plan, *, quota_bytes: int | None, quota_files: int | None) -> int:
    """Copy ``plan``'s wheels into the sandbox's /mnt/data/.wheelhouse (as the sandbox user, within
    the session's quota), in chunks, so a wheel of any size goes. A stateless sandbox that got only
    part of them is not reused. Returns how many wheels it copied."""
    try:
        for path in plan.wheels:
            size = (await anyio.Path(path).stat()).st_size
            destination = f"{WHEELHOUSE}/{path.name}"
            try:
                await upload(
                    sandbox,
                    destination,
                    file_chunks(str(path)),
                    max_bytes=size,
                    total=size,
                    quota_bytes=quota_bytes,
                    quota_files=quota_files,
                )
            except FileOperationError as exc:
                raise PackageError(f"the wheels could not be copied into the sandbox: {exc}") from None
    except BaseException:
        if sandbox.kind == "stateless":
            sandbox.broken = True  # it may hold some of them: never hand it to another run
        raise
    return len(plan.wheels)
