"""Wheels for the sandbox, fetched on the host with the host's own pip (its index, its mirror, its
certificates, its proxy): the image's locked set for ``image build``, and the packages a run asks
for with ``pip install``.

Only wheels, for the sandbox's interpreter (CPython 3.11 on Debian bookworm, manylinux): pip runs
with ``--only-binary=:all:`` and target-platform flags, so nothing is ever built or run on the host.
pip is driven as a subprocess (its API is private); its JSON report is the contract.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from ...errors import SandboxError

SANDBOX_PYTHON = "3.11"
GLIBC_MINOR = 36  # Debian bookworm's glibc 2.36
ARCHES = {"x86_64": "x86_64", "amd64": "x86_64", "aarch64": "aarch64", "arm64": "aarch64"}
PIP_TIMEOUT_S = 600


class WheelError(SandboxError):
    """A wheel could not be resolved or fetched; the message says which and why."""


class NoDistribution(WheelError):
    """pip found nothing it may use for ``requirement`` (no such project, or no wheel for the sandbox)."""

    def __init__(self, message: str, requirement: str) -> None:
        super().__init__(message)
        self.requirement = requirement


@dataclass(frozen=True)
class Pin:
    """One locked or resolved package: its exact version and the sha256 of each acceptable wheel."""

    name: str
    version: str
    hashes: tuple[str, ...] = ()
    url: str = ""


def normalize(name: str) -> str:
    """A project name as the index compares them (PEP 503)."""
    return re.sub(r"[-_.]+", "-", name).lower()


def sandbox_arch(engine_arch: str) -> str:
    arch = ARCHES.get(engine_arch.lower())
    if arch is None:
        raise WheelError(f"the engine runs on {engine_arch!r}; sandbox wheels exist for x86_64 and aarch64 only")
    return arch


def platform_flags(arch: str) -> list[str]:
    """pip's flags for wheels the sandbox's interpreter can load, on ``arch``."""
    flags = ["--only-binary=:all:", "--python-version", SANDBOX_PYTHON, "--implementation", "cp", "--abi", "cp311"]
    for minor in range(GLIBC_MINOR, 16, -1):  # pip does not widen manylinux_2_X to older minors by itself
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


def _pip(args: Sequence[str], what: str) -> subprocess.CompletedProcess[str]:
    command = [sys.executable, "-m", "pip", "--disable-pip-version-check", "--no-input", *args]
    try:
        done = subprocess.run(command, capture_output=True, text=True, timeout=PIP_TIMEOUT_S, check=False)
    except FileNotFoundError as exc:  # pragma: no cover - sys.executable exists
        raise WheelError(f"{what}: pip could not be started ({exc})") from None
    except subprocess.TimeoutExpired:
        raise WheelError(f"{what}: pip took longer than {PIP_TIMEOUT_S} s (is the index reachable?)") from None
    if done.returncode != 0:
        output = done.stderr or done.stdout
        missing = re.search(r"No matching distribution found for (\S+)", output)
        if missing is not None:
            raise NoDistribution(f"{what}: {pip_problem(output)}", missing.group(1))
        raise WheelError(f"{what}: {pip_problem(output)}")
    return done


def pip_problem(output: str) -> str:
    """The line of pip's output that says what went wrong, in words a user can act on."""
    lines = [line.strip() for line in output.splitlines() if line.strip()]
    for line in lines:
        if "No matching distribution found for" in line:
            name = line.rsplit("for", 1)[-1].strip()
            return (
                f"no wheel of {name} for the sandbox (CPython {SANDBOX_PYTHON}, Linux) on the index: the name may be "
                "wrong, or the package exists only as source, which is never built here"
            )
    for line in lines:
        if any(word in line for word in ("NewConnectionError", "Max retries", "Temporary failure in name resolution")):
            return (
                "the package index cannot be reached from the server's machine; pip's own configuration "
                "(`pip config list`: index-url, proxy, certificates) decides where wheels come from"
            )
    pinned = [line.split("(constraint)", 1)[1].strip() for line in lines if "requested (constraint)" in line]
    if pinned:
        return (
            f"it conflicts with the packages built into the sandbox image ({', '.join(pinned)[:300]}); ask for a "
            "version that works with those, or build a custom image (`mcp-code-exec image custom --requirements`)"
        )
    errors = [line for line in lines if line.startswith("ERROR")]
    return (errors or lines or ["pip failed without saying why"])[-1][:500]


def resolve(
    requirements: Sequence[str], arch: str, *, constraints: dict[str, Pin] | None = None, pre: bool = False
) -> list[Pin]:
    """The full set of packages ``requirements`` need in the sandbox, by pip's resolver (no install,
    no build): each with its version, wheel URL and sha256."""
    with tempfile.TemporaryDirectory(prefix="mcp-code-exec-resolve-") as tmp:
        args = ["install", "--dry-run", "--ignore-installed", "--quiet", "--report", f"{tmp}/report.json"]
        args += ["--target", f"{tmp}/target", *platform_flags(arch), *(["--pre"] if pre else [])]
        if constraints:
            constraint_file = Path(tmp, "constraints.txt")
            constraint_file.write_text("".join(f"{pin.name}=={pin.version}\n" for pin in constraints.values()))
            args += ["-c", str(constraint_file)]
        _pip([*args, *requirements], "resolving " + " ".join(requirements)[:200])
        report = json.loads(Path(tmp, "report.json").read_text())
    pins = []
    for item in report.get("install", []):
        info = item["download_info"]
        digest = (info.get("archive_info") or {}).get("hashes", {}).get("sha256")
        if not digest:
            raise WheelError(f"the index gave no sha256 for {info.get('url', '?')}; only hash-checked wheels are used")
        metadata = item["metadata"]
        pins.append(Pin(normalize(metadata["name"]), metadata["version"], (digest,), info["url"]))
    return pins


def index_versions(name: str) -> list[str] | None:
    """The versions the index has of ``name`` in any form (source, any platform); None when it has
    no such project. Tells "no such package" from "no wheel for the sandbox"; nothing is built."""
    try:
        done = _pip(["index", "versions", name], f"looking up {name}")
    except WheelError:
        return None
    found = re.search(r"Available versions:\s*(.+)", done.stdout)
    return [version.strip() for version in found.group(1).split(",")] if found else []


def fetch(pins: Sequence[Pin], arch: str, cache_dir: Path) -> list[Path]:
    """The wheels of ``pins`` in ``cache_dir`` (downloaded, hash-checked, only what is missing)."""
    cache_dir.mkdir(parents=True, exist_ok=True)
    missing = [pin for pin in pins if find_wheel(cache_dir, pin) is None]
    if missing:
        with tempfile.TemporaryDirectory(prefix="mcp-code-exec-fetch-") as tmp:
            requirements = Path(tmp, "requirements.txt")
            requirements.write_text(
                "".join(
                    f"{pin.name}=={pin.version} " + " ".join(f"--hash=sha256:{h}" for h in pin.hashes) + "\n"
                    for pin in missing
                )
            )
            download = ["download", "--quiet", "--no-deps", "--require-hashes", "-r", str(requirements)]
            _pip([*download, "-d", str(cache_dir), *platform_flags(arch)], f"fetching {len(missing)} wheels")
    found = []
    for pin in pins:
        wheel = find_wheel(cache_dir, pin)
        if wheel is None:
            raise WheelError(f"pip reported success but no wheel of {pin.name} {pin.version} is in {cache_dir}")
        found.append(wheel)
    return found


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
    import hashlib

    stat = path.stat()
    key = (str(path), stat.st_size, stat.st_mtime_ns)
    if key not in _HASHES:
        digest = hashlib.sha256()
        with path.open("rb") as stream:
            for chunk in iter(lambda: stream.read(1 << 20), b""):
                digest.update(chunk)
        _HASHES[key] = digest.hexdigest()
    return _HASHES[key]


def cache_root(configured: str | None = None) -> Path:
    """Where fetched wheels are kept between builds and runs."""
    if configured:
        return Path(os.path.expanduser(configured))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mcp-code-exec" / "wheels"


def copy_into(wheels: Iterable[Path], directory: Path) -> None:
    """Put ``wheels`` into ``directory`` (hard links where the filesystem allows, else copies)."""
    directory.mkdir(parents=True, exist_ok=True)
    for wheel in wheels:
        target = directory / wheel.name
        try:
            os.link(wheel, target)
        except OSError:
            shutil.copyfile(wheel, target)
