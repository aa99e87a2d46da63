"""Packages for sandboxes that have no network: resolved and fetched on the host, copied in.

Before a cell runs, ``plan`` reads what its ``pip install`` lines ask for (``requirements``),
holds it to the ``[packages]`` policy, resolves it with the host's own pip against the image's lock
(so nothing already in the image moves, and what is already there is not fetched again), and
fetches the wheels, hash-checked, into a cache shared by every sandbox (``wheels``): a package a
sandbox installed once is not downloaded again, and the same request is not even resolved again
for a while (nor one pip could not resolve). ``ship`` then puts the wheels into the sandbox's
``/mnt/data/.wheelhouse``, where the sandbox's own ``pip`` (offline, ``--no-index``) installs them
into the session's site directory ``/mnt/data/.packages`` (see ``mcpx_agent/worker/packages.py``); the
wheelhouse goes after the cell. Only wheels: pip runs with ``--only-binary=:all:``, so nothing is
built or run on the host, and it runs isolated, in a private place, on names only (``wheels``).

The host's work for a call is bounded (``hostpip``): a pool of its own with a share per client
identity, a timeout of its own, and it ends with the call. The size policy holds before anything
reaches the cache: sizes the index tells (a local index's files) are checked before downloading,
and a download is stopped as soon as it goes past what the install may bring; the cache itself is
bounded (``cache_max_mb``), the least recently used wheels going first.
"""

from __future__ import annotations

import logging
import re
import time
from collections import Counter
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

import anyio
import anyio.to_thread

from ...config.sections import PackageSettings
from ...config.units import MIB
from ...errors import DownloadTooLarge, FileOperationError, NoDistribution, PackageError, PipTimeout, WheelError
from ...models import ErrorInfo
from ...observability import metrics
from ...observability.tracing import span
from ...sandbox.container import Sandbox
from ...sandbox.image import context_dir
from ...sandbox.transfer import file_chunks, upload
from ..run_registry import Run
from . import wheels
from .hostpip import HostPip
from .requirements import PackageRequest, Pin, check_denied, check_requested, normalize, pip_form, prescan
from .wheelcache import WheelCache, cached, index_sizes, sizes, used

log = logging.getLogger(__name__)
WHEELHOUSE = ".wheelhouse"  # under /mnt/data (the agent's packages.WHEELHOUSE)
RESOLUTIONS_KEPT = 256
RESOLUTION_TTL_S = 3600.0  # the index may publish new versions; a resolution is reused this long
T = TypeVar("T")


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
    failure_hits: int = 0  # requests refused from memory: pip could not resolve them a moment ago
    downloaded: int = 0  # wheels fetched from the index
    cached: int = 0  # wheels found in the disk cache
    shipped: int = 0  # wheels copied into sandboxes
    evicted: int = 0  # wheels dropped from the cache to keep it within cache_max_mb
    downloads_by_owner: Counter[str] = field(default_factory=Counter)  # wheels fetched for each client identity
    bytes_by_owner: Counter[str] = field(default_factory=Counter)  # and their bytes


class Packages:
    def __init__(
        self,
        settings: PackageSettings,
        engine_arch: Callable[[], Awaitable[str]],
        lock: Path | None = None,
        admit: Callable[[str, int], Awaitable[ErrorInfo | None]] | None = None,
    ) -> None:
        """``admit(owner, count)``: the owner's quota of package installs (the refusal past it)."""
        self.settings = settings
        self.admit = admit
        self.stats = PackageStats()
        self.host = HostPip(settings.pip_workers, settings.pip_workers_per_client, settings.pip_timeout_s)
        self._engine_arch = engine_arch
        self._arch: str | None = None
        self._lock_path = lock or context_dir() / "requirements.lock"
        self._lock: dict[str, Pin] | None = None
        self._resolved: dict[tuple[object, ...], tuple[float, tuple[Pin, ...]]] = {}
        self._failed: dict[tuple[object, ...], tuple[float, str]] = {}
        self.cache = WheelCache(wheels.cache_root(settings.cache_dir), settings.cache_max_bytes)
        self._storing = anyio.Lock()  # moves into the cache and evictions (file operations only, never pip)

    async def prepare(
        self,
        sandbox: Sandbox,
        run: Run,
        code: str,
        extra: Sequence[str],
        *,
        quota_bytes: int | None = None,
        quota_files: int | None = None,
    ) -> ErrorInfo | None:
        """Copy in what the cell's pip lines and ``extra`` need for ``run``, within its own timeout
        (the host's pip runs for it end when it does); when refused, the run's error. The packages
        count against its owner's quota (``admit``) before anything is copied in, and in its usage
        (``Run.installed``) once they are."""
        owner, timeout_s = run.owner, run.timeout_s
        if not extra and "pip" not in code:  # the common case: nothing to install, nothing to measure
            return None
        began, outcome = time.monotonic(), "ok"
        try:
            with anyio.fail_after(timeout_s), span("mcpx.packages.install", requested=len(extra)):
                plan = await self.plan(code, extra, owner=owner)
                if plan is None:
                    outcome = ""  # its pip lines install nothing
                    return None
                try:
                    if self.admit is not None and (refused := await self.admit(owner, len(plan.wheels))):
                        outcome = "refused"
                        return refused
                    shipped = await ship(sandbox, plan, quota_bytes=quota_bytes, quota_files=quota_files)
                finally:
                    self.release(plan)
                self.stats.shipped += shipped
                run.installed(shipped)
        except TimeoutError:
            outcome = "timeout"
            message = f"getting the packages took longer than the run's timeout ({timeout_s:g} s); give it more time"
            return ErrorInfo(type="PackageError", message=f"{message}. Nothing of the cell was run.")
        except PackageError as exc:
            outcome = "refused"
            return ErrorInfo(type="PackageError", message=f"{exc}. Nothing of the cell was run.")
        except anyio.get_cancelled_exc_class():
            outcome = ""  # the run was cancelled: not an install's outcome
            raise
        except Exception:
            outcome = "failed"
            raise
        finally:
            if outcome:
                metrics.packages_installed(outcome, time.monotonic() - began)
        return None

    async def plan(self, code: str, extra: Sequence[str] = (), *, owner: str = "") -> Plan | None:
        """What the cell's pip lines (and ``extra``) need, fetched; None when it installs nothing.
        PackageError, with a sentence for the model, when the request is refused or cannot be served.
        The plan's wheels stay in the cache until ``release``."""
        request = prescan(code, extra)
        if request is None:
            return None
        check_requested(request.names, self.settings)
        arch = await self.arch()
        pins = await self._resolve(request, arch, owner)
        check_denied((pin.name for pin in pins), self.settings, wanted_by=", ".join(request.names))
        return await self._gather(request, pins, arch, owner)

    def release(self, plan: Plan) -> None:
        """The plan's wheels were shipped (or never will be): the cache may drop them again."""
        self.cache.release(plan.wheels)

    async def arch(self) -> str:
        if self._arch is None:
            try:
                self._arch = wheels.sandbox_arch(await self._engine_arch())
            except WheelError as exc:
                raise PackageError(str(exc)) from None
        return self._arch

    # -- resolving --------------------------------------------------------------------------------
    async def _resolve(self, request: PackageRequest, arch: str, owner: str) -> tuple[Pin, ...]:
        key = (arch, *request.key)
        now = time.monotonic()
        hit = self._resolved.get(key)
        if hit is not None and now - hit[0] < RESOLUTION_TTL_S:
            self.stats.resolution_hits += 1
            log.info("packages %s: resolution cached (%d wheels)", " ".join(request.requirements)[:200], len(hit[1]))
            return hit[1]
        failed = self._failed.get(key)
        if failed is not None and now - failed[0] < self.settings.failed_ttl_s:
            self.stats.failure_hits += 1
            raise PackageError(failed[1])
        try:
            pins = await self._resolve_with_pip(request, arch, owner)
        except PipTimeout as exc:  # the index may be slow for a moment: not remembered
            raise PackageError(str(exc)) from None
        except PackageError as exc:
            if self.settings.failed_ttl_s > 0:
                remember(self._failed, key, (now, str(exc)))
            raise
        self.stats.resolutions += 1
        log.info(
            "packages %s: resolved in %.0f ms (%d wheels to ship)",
            " ".join(request.requirements)[:200],
            (time.monotonic() - now) * 1000,
            len(pins),
        )
        remember(self._resolved, key, (now, pins))
        self._failed.pop(key, None)
        return pins

    async def _resolve_with_pip(self, request: PackageRequest, arch: str, owner: str) -> tuple[Pin, ...]:
        lock = self.image_lock()
        run = self.host.runner(owner)
        try:
            pins = await wheels.resolve_with(
                run,
                [pip_form(requirement) for requirement in request.requirements],
                arch,
                constraints=lock,
                pre=request.pre,
                max_bytes=self.settings.cache_max_bytes,
            )
        except NoDistribution as exc:
            versions = await wheels.index_versions_with(run, exc.requirement)
            raise PackageError(missing(exc.requirement, arch, versions)) from None
        except DownloadTooLarge:
            raise PackageError(
                f"resolving {', '.join(request.names)} took more than {self.settings.cache_max_mb} MiB of downloads "
                "on the server ([packages] cache_max_mb)"
            ) from None
        except PipTimeout:
            raise
        except WheelError as exc:
            raise PackageError(str(exc)) from None
        # What the image has at that version is there already (the lock constrains the rest).
        return tuple(pin for pin in pins if pin.name not in lock or lock[pin.name].version != pin.version)

    # -- fetching -----------------------------------------------------------------------------------
    async def _gather(self, request: PackageRequest, pins: Sequence[Pin], arch: str, owner: str) -> Plan:
        """The wheels of ``pins``: from the cache, else downloaded, never past ``max_mb``; those
        downloaded go into the cache only once the whole install is known to be allowed."""
        limit = self.settings.max_bytes
        found_cached = await anyio.to_thread.run_sync(cached, self.cache.root / arch, pins)
        kept: list[Path] = list(found_cached.values())
        self.cache.hold(kept)
        try:
            have = sum(size for size in await anyio.to_thread.run_sync(sizes, kept))
            missing_pins = [pin for pin in pins if pin not in found_cached]
            known = await anyio.to_thread.run_sync(index_sizes, missing_pins)
            if have + sum(known) > limit:  # refused before anything is downloaded
                raise self._too_large(request, have + sum(known))
            if missing_pins:
                stored = await self._download(request, missing_pins, arch, owner, limit - have)
                kept += stored
                self.stats.downloaded += len(stored)
            self.stats.cached += len(found_cached)
            found = await anyio.to_thread.run_sync(used, kept)
        except BaseException:
            self.cache.release(kept)
            raise
        total = sum(found.values())
        return Plan(request, tuple(found), total)

    async def _download(
        self, request: PackageRequest, pins: Sequence[Pin], arch: str, owner: str, budget: int
    ) -> list[Path]:
        """Download ``pins`` into a private place, stopped past ``budget`` bytes; then into the cache."""
        with wheels.Place.made() as place:
            what = f"fetching {len(pins)} wheels"
            try:
                await self.host.run(owner, wheels.download_args(pins, arch, place), what, place, max_bytes=budget)
                staged = wheels.staged(place, pins)
            except DownloadTooLarge:
                raise self._too_large(request, None) from None
            except WheelError as exc:
                raise PackageError(str(exc)) from None
            size = sum(await anyio.to_thread.run_sync(sizes, staged))
            if size > budget:
                raise self._too_large(request, self.settings.max_bytes - budget + size)
            self.stats.downloads_by_owner[owner] += len(staged)
            self.stats.bytes_by_owner[owner] += size
            async with self._storing:
                stored = await anyio.to_thread.run_sync(self.cache.put, staged, arch, size)
            self.stats.evicted = self.cache.evicted
            return stored

    def _too_large(self, request: PackageRequest, size: int | None) -> PackageError:
        """The refusal of an install of ``size`` bytes (None: more than allowed, stopped midway)."""
        amount = f"more than {self.settings.max_mb} MiB" if size is None else f"{size / MIB:.0f} MiB"
        return PackageError(
            f"{', '.join(request.names)} would bring {amount} of wheels; this server allows "
            f"{self.settings.max_mb} MiB per install ([packages] max_mb)"
        )

    def image_lock(self) -> dict[str, Pin]:
        if self._lock is None:
            self._lock = wheels.read_lock(self._lock_path.read_text())
        return self._lock


def remember(table: dict[tuple[object, ...], T], key: tuple[object, ...], value: T) -> None:
    table[key] = value
    while len(table) > RESOLUTIONS_KEPT:
        table.pop(next(iter(table)))


def missing(requirement: str, arch: str, versions: list[str] | None) -> str:
    """Why pip found nothing for ``requirement``: no such project (``versions`` None), or none of
    it the sandbox can use (``versions``: what the index has of it in any form)."""
    name = normalize(re.split(r"[\s\[<>=!~;(]", requirement, maxsplit=1)[0])
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
            sandbox.mark_broken("broken")  # it may hold some of them: never hand it to another run
        raise
    return len(plan.wheels)
