"""One run of the host's pip, made so that nothing a sandbox wrote is executed, imported, built or
even looked up on the host.

pip runs isolated (``python -I``: neither the working directory nor the user's site directory nor
PYTHON* variables reach its ``sys.path``), in a private place of its own (``Place``: an empty
working directory, its temporary directory, its downloads), with an environment reduced to what pip
needs (its own PIP_* settings, the proxies, certificates, the home directory for its configuration;
not the server's tokens). What it is asked for reaches it only as names (``requirements.pip_form``).
``run_blocking`` waits for it (image builds); the server's own runs go through ``hostpip``.
"""

from __future__ import annotations

import os
import re
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Awaitable, Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from ...errors import NoDistribution, PipTimeout, WheelError

SANDBOX_PYTHON = "3.11"
PIP_TIMEOUT_S = 600  # image builds (the server's own runs have [packages] pip_timeout_s)
# The environment pip gets: these variables, every PIP_* one, and the proxies; nothing else (the
# server's tokens, PYTHONPATH and the like stay behind).
PIP_ENVIRONMENT = {
    "PATH", "HOME", "USER", "LOGNAME", "LANG", "LANGUAGE", "LC_ALL", "LC_CTYPE", "LC_MESSAGES", "TZ", "SYSTEMROOT",
    "XDG_CONFIG_HOME", "XDG_CONFIG_DIRS", "XDG_CACHE_HOME", "XDG_DATA_HOME", "NETRC",
    "SSL_CERT_FILE", "SSL_CERT_DIR", "REQUESTS_CA_BUNDLE", "CURL_CA_BUNDLE",
}  # fmt: skip
PROXIES = {"http_proxy", "https_proxy", "ftp_proxy", "all_proxy", "no_proxy"}


@dataclass(frozen=True)
class Place:
    """A private directory for one run of pip (mode 0700): an empty working directory (``cwd``),
    its temporary directory (``tmp``), what it downloads (``out``), its report and input files."""

    root: Path

    @property
    def cwd(self) -> Path:
        return self.root / "cwd"

    @property
    def tmp(self) -> Path:
        return self.root / "tmp"

    @property
    def out(self) -> Path:
        return self.root / "out"

    @property
    def report(self) -> Path:
        return self.root / "report.json"

    @classmethod
    @contextmanager
    def made(cls) -> Iterator[Place]:
        place = cls(Path(tempfile.mkdtemp(prefix="mcp-code-exec-pip-")))
        try:
            for directory in (place.cwd, place.tmp, place.out):
                directory.mkdir(mode=0o700)
            yield place
        finally:
            shutil.rmtree(place.root, ignore_errors=True)

    def environment(self, environ: dict[str, str] | None = None) -> dict[str, str]:
        """What pip needs of the server's environment, and nothing else; its temporary files here."""
        source = os.environ if environ is None else environ
        kept = {
            key: value
            for key, value in source.items()
            if key in PIP_ENVIRONMENT or key.startswith("PIP_") or key.lower() in PROXIES
        }
        kept.update(TMPDIR=str(self.tmp), TEMP=str(self.tmp), TMP=str(self.tmp), PWD=str(self.cwd))
        return kept

    def downloaded(self) -> int:
        """Bytes pip has downloaded so far: its temporary directory, or what it saved from there
        (a wheel is in both for a moment, as pip copies it out; at most twice this is on disk)."""
        return max(tree_size(self.tmp), tree_size(self.out))


def tree_size(root: Path) -> int:
    total = 0
    for directory, _, files in os.walk(root):
        for name in files:
            try:
                total += os.lstat(os.path.join(directory, name)).st_size
            except OSError:
                continue  # gone since it was listed
    return total


def pip_command(args: Sequence[str]) -> list[str]:
    """The host's pip, isolated: ``-I`` keeps the working directory, the user's site directory and
    PYTHON* variables off its path; no cache of pip's own (the wheel cache is ours, and bounded)."""
    return [
        sys.executable, "-I", "-m", "pip", "--disable-pip-version-check", "--no-input", "--no-cache-dir", *args
    ]  # fmt: skip


Runner = Callable[[Sequence[str], str, Place, "int | None"], Awaitable[str]]
"""Runs pip with ``args`` in ``place`` (``what`` for messages), its downloads bounded to that many
bytes; returns its standard output, or raises a ``WheelError`` (see ``failure``)."""


def run_blocking(args: Sequence[str], what: str, place: Place, max_bytes: int | None = None) -> str:
    """pip in ``place``, waited for (image builds; the server's own runs go through ``hostpip``)."""
    del max_bytes  # image builds fetch the image's own lock
    try:
        done = subprocess.run(
            pip_command(args),
            cwd=place.cwd,
            env=place.environment(),
            stdin=subprocess.DEVNULL,
            capture_output=True,
            text=True,
            timeout=PIP_TIMEOUT_S,
            check=False,
        )
    except FileNotFoundError as exc:  # pragma: no cover - sys.executable exists
        raise WheelError(f"{what}: pip could not be started ({exc})") from None
    except subprocess.TimeoutExpired:
        raise PipTimeout(f"{what}: pip took longer than {PIP_TIMEOUT_S} s (is the index reachable?)") from None
    if done.returncode != 0:
        raise failure(done.stderr or done.stdout, what)
    return done.stdout


def failure(output: str, what: str) -> WheelError:
    """The error for a run of pip that failed with ``output``."""
    missing = re.search(r"No matching distribution found for (\S+)", output)
    if missing is not None:
        return NoDistribution(f"{what}: {pip_problem(output)}", missing.group(1))
    return WheelError(f"{what}: {pip_problem(output)}")


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
