"""The wheel cache on the host: wheels fetched once for every sandbox, kept within a bound.

Wheels come in whole (``store``: downloaded elsewhere first, then moved in), are found by name,
version and sha256 (``find_wheel``), and are dropped least recently used first when the cache would
go past ``[packages] cache_max_mb`` (``WheelCache``); a wheel an install still has to copy into its
sandbox is never dropped.
"""

from __future__ import annotations

import hashlib
import logging
import os
import shutil
import time
import urllib.parse
import urllib.request
from collections import Counter
from collections.abc import Iterable, Sequence
from pathlib import Path

from ...config.mounts import wheel_cache
from ...config.units import MIB
from ...errors import PackageError
from .requirements import Pin, normalize

log = logging.getLogger(__name__)


class WheelCache:
    """The cache under ``root`` (one directory per architecture), at most ``max_bytes``."""

    def __init__(self, root: Path, max_bytes: int) -> None:
        self.root = root
        self.max_bytes = max_bytes
        self.in_use: Counter[Path] = Counter()  # wheels of installs not yet copied in: never dropped
        self.evicted = 0

    def hold(self, paths: Iterable[Path]) -> None:
        self.in_use.update(paths)

    def release(self, paths: Iterable[Path]) -> None:
        self.in_use.subtract(paths)
        self.in_use = +self.in_use

    def put(self, staged: list[Path], arch: str, size: int) -> list[Path]:
        """Room made (least recently used first, never what an install holds), then ``staged``
        (``size`` bytes) moved in; they are held from then on. PackageError when no room can be made."""
        directory = self.root / arch
        bound = self.max_bytes
        entries = sorted(cache_entries(self.root), key=lambda entry: entry[1])  # oldest use first
        total = sum(entry[2] for entry in entries)
        names = {wheel.name for wheel in staged}
        for path, _, bytes_ in entries:
            if total + size <= bound:
                break
            if self.in_use[path] or (path.parent == directory and path.name in names):
                continue
            path.unlink(missing_ok=True)
            total -= bytes_
            self.evicted += 1
            log.info("wheel cache: dropped %s (least recently used; [packages] cache_max_mb)", path.name)
        if total + size > bound:
            raise PackageError(
                f"the server's wheel cache ([packages] cache_max_mb = {self.max_bytes // MIB}) is full of wheels "
                "other runs are installing right now; try again in a moment"
            )
        stored = store(staged, directory)
        self.hold(stored)
        return stored

    def size(self) -> int:
        return sum(entry[2] for entry in cache_entries(self.root))


def cached(directory: Path, pins: Sequence[Pin]) -> dict[Pin, Path]:
    """The wheels of ``pins`` the cache has (hash-checked)."""
    if not directory.is_dir():
        return {}
    found = {}
    for pin in pins:
        wheel = find_wheel(directory, pin)
        if wheel is not None:
            found[pin] = wheel
    return found


def sizes(paths: Sequence[Path]) -> list[int]:
    return [path.stat().st_size for path in paths]


def used(paths: Sequence[Path]) -> dict[Path, int]:
    """Each wheel's size, its last use set to now (the cache drops the least recently used first)."""
    now = time.time_ns()
    found = {}
    for path in paths:
        stat = path.stat()
        os.utime(path, ns=(now, stat.st_mtime_ns))  # the access time is the last use; mtime keeps the hash
        found[path] = stat.st_size
    return found


def index_sizes(pins: Sequence[Pin]) -> list[int]:
    """The sizes the index tells before anything is downloaded: those of a local (``file:``) index's
    wheels. Others are held to the bound while they download."""
    known = []
    for pin in pins:
        parsed = urllib.parse.urlsplit(pin.url)
        if parsed.scheme == "file":
            try:
                known.append(os.stat(urllib.request.url2pathname(parsed.path)).st_size)
            except OSError:
                continue
    return known


def cache_entries(root: Path) -> list[tuple[Path, int, int]]:
    """Every wheel in the cache (all architectures): path, last use (ns), bytes."""
    entries: list[tuple[Path, int, int]] = []
    if not root.is_dir():
        return entries
    for directory in root.iterdir():
        if not directory.is_dir():
            continue
        for path in directory.glob("*.whl"):
            try:
                stat = path.stat()
            except FileNotFoundError:
                continue
            entries.append((path, max(stat.st_atime_ns, stat.st_mtime_ns), stat.st_size))
    return entries


def store(wheels: Iterable[Path], cache_dir: Path) -> list[Path]:
    """Move downloaded wheels into the cache, each whole or not at all."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    stored = []
    for wheel in wheels:
        target = cache_dir / wheel.name
        try:
            os.replace(wheel, target)
        except OSError:  # another filesystem: a copy under a temporary name first
            partial = cache_dir / f".{wheel.name}.{os.getpid()}.partial"
            shutil.copyfile(wheel, partial)
            os.replace(partial, target)
        stored.append(target)
    return stored


def cache_root(configured: str | None = None) -> Path:
    """Where fetched wheels are kept between builds and runs."""
    return wheel_cache(configured, os.environ)


def find_wheel(directory: Path, pin: Pin) -> Path | None:
    """The wheel of ``pin`` in ``directory`` whose sha256 is one of the pin's (any, if it has none)."""
    for path in directory.glob("*.whl"):
        name, _, rest = path.name.partition("-")
        version = rest.partition("-")[0]
        if normalize(name) != pin.name or version != pin.version:
            continue
        if not pin.hashes or sha256_of(path) in pin.hashes:
            return path
    return None


_HASHES: dict[tuple[str, int, int], str] = {}


def sha256_of(path: Path) -> str:
    """The file's sha256, remembered while it is unchanged (a build checks hundreds of MB of wheels)."""
    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHES:
        digest = hashlib.sha256()
        with path.open("rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                digest.update(chunk)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]
