"""Wheels for the sandbox, fetched on the host with the host's own pip (its index, its mirror, its
certificates, its proxy): the image's locked set for ``image build``, and the packages a run asks
for with ``pip install``.

Only wheels, for the sandbox's interpreter (CPython 3.11 on Debian bookworm, manylinux): pip runs
with ``--only-binary=:all:`` and target-platform flags, so nothing is ever built or run on the host.
pip is driven as a subprocess (its API is private), isolated and in a private place (``pipcall``);
its JSON report is the contract. Wheels are downloaded into that place, then moved into the cache
(``wheelcache``).
"""

from __future__ import annotations

import json
import os
import re
import shutil
from collections.abc import Iterable, Sequence
from pathlib import Path
from typing import NamedTuple

from ...errors import PipTimeout, WheelError
from .pipcall import PIP_TIMEOUT_S, SANDBOX_PYTHON, Place, Runner, failure, pip_problem, run_blocking
from .requirements import ARCHIVE_SUFFIXES, Pin, normalize
from .wheelcache import cache_root, find_wheel, sha256_of, store

GLIBC_MINOR = 36  # Debian bookworm's glibc 2.36


class Interpreter(NamedTuple):
    """Whose wheels: a CPython version, its ABI, and the newest glibc minor of its Debian."""

    python: str = SANDBOX_PYTHON
    abi: str = "cp311"
    glibc_minor: int = GLIBC_MINOR


SANDBOX = Interpreter()
EGRESS_PROXY = Interpreter("3.13", "cp313", 41)  # the egress proxy's image: Debian trixie's python3
ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}


def sandbox_arch(engine_arch: str) -> str:
    arch = ARCHES.get(engine_arch.lower())
    if arch is None:
        raise WheelError(f"the engine runs on {engine_arch!r}; sandbox wheels exist for x86_64 and aarch64 only")
    return arch


def platform_flags(arch: str, target: Interpreter = SANDBOX) -> list[str]:
    """pip's flags for wheels ``target`` (the sandbox's interpreter by default) can load, on ``arch``."""
    flags = ["--only-binary=:all:", "--python-version", target.python, "--implementation", "cp", "--abi", target.abi]
    for minor in range(target.glibc_minor, 16, -1):  # pip does not widen manylinux_2_X to older minors by itself
        flags += ["--platform", f"manylinux_2_{minor}_{arch}"]
    flags += ["--platform", f"manylinux2014_{arch}"]
    if arch == "x86_64":
        flags += ["--platform", "manylinux2010_x86_64", "--platform", "manylinux1_x86_64"]
    return flags


def read_lock(text: str) -> dict[str, Pin]:
    """The pins of a lock file (``name==version \\`` then ``--hash=sha256:...`` lines), by name."""
    pins: dict[str, Pin] = {}
    for block in re.split(r"\n(?=\S)", text):
        found = re.match(r"^([A-Za-z0-9][A-Za-z0-9._-]*)==(\S+)", block.strip())
        if found is None:
            continue
        name = normalize(found.group(1))
        pins[name] = Pin(name, found.group(2), tuple(re.findall(r"--hash=sha256:([0-9a-f]{64})", block)))
    return pins


def write_lock(pins: Iterable[Pin], header: str) -> str:
    lines = [f"# {line}" if line else "#" for line in header.splitlines()] + [""]
    for pin in sorted(pins, key=lambda p: p.name):
        hashes = " \\\n".join(f"    --hash=sha256:{digest}" for digest in sorted(set(pin.hashes)))
        lines.append(f"{pin.name}=={pin.version} \\\n{hashes}")
    return "\n".join(lines) + "\n"


def resolve_args(
    requirements: Sequence[str],
    arch: str,
    place: Place,
    *,
    constraints: dict[str, Pin] | None,
    pre: bool,
    target: Interpreter = SANDBOX,
) -> list[str]:
    args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", str(place.report)]
    args += ["--target", str(place.root / "target"), *platform_flags(arch, target), *(["--pre"] if pre else [])]
    if target != SANDBOX:
        # pip's install (unlike its download) checks Requires-Python against the interpreter it runs
        # on, whatever --python-version says; the platform flags already select ``target``'s wheels.
        args.append("--ignore-requires-python")
    if constraints:
        constraint_file = place.root / "constraints.txt"
        constraint_file.write_text("".join(pin_line(pin) + "\n" for pin in constraints.values()))
        args += ["-c", str(constraint_file)]
    return [*args, "--", *requirements]


def read_report(place: Place) -> list[Pin]:
    """The packages of pip's installation report, each with its version, wheel URL and sha256."""
    report = json.loads(place.report.read_text())
    pins = []
    for item in report.get("install", []):
        info = item["download_info"]
        digest = (info.get("archive_info") or {}).get("hashes", {}).get("sha256")
        if not digest:
            raise WheelError(f"the index gave no sha256 for {info.get('url', '?')}; only hash-checked wheels are used")
        metadata = item["metadata"]
        pins.append(Pin(normalize(metadata["name"]), metadata["version"], (digest,), info["url"]))
    return pins


def pin_line(pin: Pin) -> str:
    """``name==version`` for pip's input files, never anything it could take for a file."""
    line = f"{pin.name}=={pin.version}"
    if not re.fullmatch(r"[a-z0-9][a-z0-9-]*==[A-Za-z0-9.+!_-]+", line) or line.lower().endswith(ARCHIVE_SUFFIXES):
        raise WheelError(f"the index named a package {line!r}, which pip would not take for a name")
    return line


def download_args(pins: Sequence[Pin], arch: str, place: Place, target: Interpreter = SANDBOX) -> list[str]:
    """pip's arguments to download ``pins``, hash-checked, into ``place.out``."""
    requirements = place.root / "requirements.txt"
    requirements.write_text(
        "".join(pin_line(pin) + " " + " ".join(f"--hash=sha256:{h}" for h in pin.hashes) + "\n" for pin in pins)
    )
    download = ["download", "--quiet", "--no-deps", "--require-hashes", "-r", str(requirements)]
    return [*download, "-d", str(place.out), *platform_flags(arch, target)]


def resolve(
    requirements: Sequence[str],
    arch: str,
    *,
    constraints: dict[str, Pin] | None = None,
    pre: bool = False,
    target: Interpreter = SANDBOX,
) -> list[Pin]:
    """The full set of packages ``requirements`` need in the sandbox (or ``target``), by pip's
    resolver (no install, no build): each with its version, wheel URL and sha256. (``requirements``:
    checked ones.)"""
    with Place.made() as place:
        args = resolve_args(requirements, arch, place, constraints=constraints, pre=pre, target=target)
        run_blocking(args, "resolving " + " ".join(requirements)[:200], place)
        return read_report(place)


async def resolve_with(
    run: Runner,
    requirements: Sequence[str],
    arch: str,
    *,
    constraints: dict[str, Pin] | None = None,
    pre: bool = False,
    max_bytes: int | None = None,
) -> list[Pin]:
    """``resolve`` through ``run`` (the server's bounded, cancellable runs of pip)."""
    with Place.made() as place:
        args = resolve_args(requirements, arch, place, constraints=constraints, pre=pre)
        await run(args, "resolving " + " ".join(requirements)[:200], place, max_bytes)
        return read_report(place)


def versions_in(output: str) -> list[str]:
    found = re.search(r"Available versions:\s*(.+)", output)
    return [version.strip() for version in found.group(1).split(",")] if found else []


def index_versions(name: str) -> list[str] | None:
    """The versions the index has of ``name`` in any form (source, any platform); None when it has
    no such project. Tells "no such package" from "no wheel for the sandbox"; nothing is built."""
    with Place.made() as place:
        try:
            return versions_in(run_blocking(["index", "versions", "--", normalize(name)], f"looking up {name}", place))
        except WheelError:
            return None


async def index_versions_with(run: Runner, name: str) -> list[str] | None:
    """``index_versions`` through ``run``."""
    with Place.made() as place:
        try:
            return versions_in(
                await run(["index", "versions", "--", normalize(name)], f"looking up {name}", place, None)
            )
        except PipTimeout:
            raise
        except WheelError:
            return None


def fetch(pins: Sequence[Pin], arch: str, cache_dir: Path, target: Interpreter = SANDBOX) -> list[Path]:
    """The wheels of ``pins`` in ``cache_dir`` (downloaded, hash-checked, only what is missing)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    missing = [pin for pin in pins if find_wheel(cache_dir, pin) is None]
    if missing:
        with Place.made() as place:
            run_blocking(download_args(missing, arch, place, target), f"fetching {len(missing)} wheels", place)
            store(staged(place, missing), cache_dir)
    return in_cache(pins, cache_dir)


def staged(place: Place, pins: Sequence[Pin]) -> list[Path]:
    """The wheels of ``pins`` that pip downloaded into ``place``."""
    found = []
    for pin in pins:
        wheel = find_wheel(place.out, pin)
        if wheel is None:
            raise WheelError(f"pip reported success but downloaded no wheel of {pin.name} {pin.version}")
        found.append(wheel)
    return found


def in_cache(pins: Sequence[Pin], cache_dir: Path) -> list[Path]:
    found = []
    for pin in pins:
        wheel = find_wheel(cache_dir, pin)
        if wheel is None:
            raise WheelError(f"pip reported success but no wheel of {pin.name} {pin.version} is in {cache_dir}")
        found.append(wheel)
    return found


def copy_into(wheels: Iterable[Path], directory: Path) -> None:
    """Put ``wheels`` into ``directory`` (hard links where the filesystem allows, else copies)."""
    directory.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        target = directory / wheel.name
        try:
            os.link(wheel, target)
        except OSError:
            shutil.copyfile(wheel, target)


__all__ = [
    "PIP_TIMEOUT_S",
    "SANDBOX_PYTHON",
    "Pin",
    "Place",
    "Runner",
    "cache_root",
    "failure",
    "find_wheel",
    "normalize",
    "pip_problem",
    "run_blocking",
    "sha256_of",
    "store",
]
