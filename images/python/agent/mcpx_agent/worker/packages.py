"""pip inside the sandbox, without a network: the session's own site directory and our ``%pip``.

The host reads a cell's ``pip install`` lines before it runs and puts the wheels they need into
``/mnt/data/.wheelhouse`` (``mcp_code_exec.service.packages.installs``). pip here never looks anywhere else
(``PIP_NO_INDEX``, ``PIP_FIND_LINKS``) and installs for the sandbox user into ``/mnt/data/.packages``
(``PIP_USER``, ``PYTHONUSERBASE``): on a session's volume it lasts as long as the session, and
counts against its disk quota. ``%pip`` (and ``!pip``, ``!python -m pip`` and a bare ``pip install``
line, which ``PipCommand`` turns into it) runs pip in a subprocess, then puts that directory on
``sys.path``, so a package is importable in the same cell. Every cell starts with it on the path
too (a new worker, after a restart, included), and ends by removing the wheelhouse.
"""

from __future__ import annotations

import importlib
import os
import re
import shlex
import shutil
import site
import subprocess
import sys
import tokenize
import zipfile
from collections import deque
from typing import Any

ROOT = "/mnt/data"
USER_BASE = f"{ROOT}/.packages"
WHEELHOUSE_NAME = ".wheelhouse"
WHEELHOUSE = f"{ROOT}/{WHEELHOUSE_NAME}"
USER_SITE = f"{USER_BASE}/lib/python{sys.version_info[0]}.{sys.version_info[1]}/site-packages"
PIP_ENV = {
    "PIP_NO_INDEX": "1",
    "PIP_FIND_LINKS": WHEELHOUSE,
    "PYTHONUSERBASE": USER_BASE,
    "PIP_BREAK_SYSTEM_PACKAGES": "1",  # Debian's python3 is "externally managed", --user installs too
    "PIP_DISABLE_PIP_VERSION_CHECK": "1",
    "PIP_NO_CACHE_DIR": "1",  # the cache would sit in /tmp, in memory, for nothing
    "PIP_PROGRESS_BAR": "off",
    "PIP_NO_WARN_SCRIPT_LOCATION": "1",
    "PIP_NO_COMPILE": "1",  # a second per small package; what is imported is compiled then
}
# The shell escapes and the bare line that run our %pip (the host's requirements.PIP_LINE reads the
# same lines, with %pip, to know what to fetch).
COMMAND = re.compile(
    r"(?:!\s*(?:pip3?|python3?\s+-m\s+pip|\{sys\.executable\}\s+-m\s+pip)"
    r"|pip3?(?=[ \t]+(?:install|uninstall|list|show|freeze|check)\b))(?=\s|$)"
)
# Shell syntax ends pip's arguments (``!pip install -q x > /dev/null 2>&1``); the host reads them so too.
SHELL_SYNTAX = re.compile(r"^(?:[|;&<>]|\d+>)")
NOT_FETCHED = (
    "the server fetches packages before a cell runs, for the `%pip install NAME` lines written in the cell "
    "(names built while it runs cannot be known in time): write the name in the pip line"
)


class PipError(Exception):
    """pip failed; the message is its own last word, explained where we can."""


def activate() -> None:
    """Put the session's site directory on ``sys.path`` once it exists (pth files included). A new
    path entry gets a fresh finder: only ``refresh`` needs to tell the import system of changes."""
    if site_dir_waiting():
        site.addsitedir(USER_SITE)


def site_dir_waiting() -> bool:
    """The session's site directory exists and is not on the path yet."""
    return USER_SITE not in sys.path and os.path.isdir(USER_SITE)


def refresh() -> None:
    """After pip ran: the directory on the path, and the import system told that it changed."""
    activate()
    importlib.invalidate_caches()


def before_cell(install: Any) -> BaseException | None:
    """At the start of every cell: the site directory on the path, and run_python's ``packages``
    installed; the error that stops the cell when they cannot be."""
    activate()
    if not install:
        return None
    try:
        unpack(WHEELHOUSE, USER_SITE)
    except (OSError, ValueError, zipfile.BadZipFile) as exc:
        return PipError(f"the packages could not be installed: {exc}")
    refresh()
    return None


def unpack(wheelhouse: str, site_dir: str) -> None:
    """Install every wheel in ``wheelhouse`` by unpacking it into ``site_dir``: the host resolved the
    set already, and a wheel is a zip of what goes there (``NAME.data/purelib|platlib`` moved up;
    scripts, headers and data left out). About 50 ms where pip takes about a second; pip still
    lists and uninstalls them (the wheel's own RECORD comes along)."""
    if not os.path.isdir(wheelhouse):
        return
    for name in sorted(os.listdir(wheelhouse)):
        if not name.endswith(".whl"):
            continue
        with zipfile.ZipFile(os.path.join(wheelhouse, name)) as wheel:
            for info in wheel.infolist():
                parts = info.filename.split("/")
                if info.filename.startswith("/") or ".." in parts:
                    raise ValueError(f"{name} holds a path outside its directory: {info.filename[:200]}")
                if parts[0].endswith(".data"):
                    if len(parts) < 3 or parts[1] not in ("purelib", "platlib"):
                        continue
                    parts = parts[2:]
                if info.is_dir() or not parts[-1]:
                    continue
                target = os.path.join(site_dir, *parts)
                os.makedirs(os.path.dirname(target), exist_ok=True)
                with wheel.open(info) as source, open(target, "wb") as sink:
                    shutil.copyfileobj(source, sink)


def after_cell() -> None:
    """What the host copied in for this cell is installed (or not wanted) now: remove it."""
    if os.path.isdir(WHEELHOUSE):
        shutil.rmtree(WHEELHOUSE, ignore_errors=True)


def pip_magic(line: str) -> None:
    """%pip: ``install`` runs pip (offline) for this session, and a new package is importable at
    once; other commands (list, show, uninstall...) go through the shell, as IPython's own %pip."""
    try:
        args = shlex.split(line, comments=True)
    except ValueError as exc:
        raise PipError(f"cannot read the pip arguments: {exc}") from None
    if args[:1] != ["install"]:
        from IPython import get_ipython

        get_ipython().system(f"{shlex.quote(sys.executable)} -m pip {line}")
        return
    cut = next((i for i, arg in enumerate(args) if SHELL_SYNTAX.match(arg)), len(args))
    silenced = any(arg.lstrip("0123456789&").startswith(">") and not arg.startswith("2") for arg in args[cut:])
    code, errors = run_pip(["install", "--user", *args[1:cut]], echo=not silenced)
    refresh()
    if code != 0:
        raise PipError(explain(errors))


def run_pip(args: list[str], *, echo: bool = True) -> tuple[int, list[str]]:
    """Run ``python -m pip ARGS``: its output goes to the cell's (``echo``), the last lines of its
    errors come back. An interrupt stops it."""
    env = {**os.environ, **PIP_ENV}
    if not os.path.isdir(WHEELHOUSE):
        del env["PIP_FIND_LINKS"]  # nothing was copied in (all in the image already): no warning about it
    for stream in (sys.stdout, sys.stderr):
        stream.flush()
    process = subprocess.Popen(  # our interpreter's pip, with the user's own arguments
        [sys.executable, "-m", "pip", *args],
        stdin=subprocess.DEVNULL,
        stdout=None if echo else subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        env=env,
        text=True,
        errors="replace",
    )
    tail: deque[str] = deque(maxlen=40)
    try:
        assert process.stderr is not None
        for text in process.stderr:
            tail.append(text.rstrip())
            if echo:
                sys.stderr.write(text)
        return process.wait(), list(tail)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()


def explain(errors: list[str]) -> str:
    lines = [line.strip() for line in errors if line.strip()]
    for line in lines:
        if "No matching distribution found for" in line:
            return f"{line.removeprefix('ERROR: ')}: {NOT_FETCHED}"
    problems = [line.removeprefix("ERROR: ") for line in lines if line.startswith("ERROR")]
    return (problems or lines or ["pip failed without saying why"])[-1][:500]


def transformer() -> type:
    """``PipCommand``: IPython's token transformer for ``!pip ...`` and a bare ``pip install ...``
    line, made here so the host's unit tests can import this module without IPython."""
    from IPython.core.inputtransformer2 import (
        TokenTransformBase,
        assemble_continued_line,
        find_end_of_continued_line,
    )

    class PipCommand(TokenTransformBase):  # type: ignore[misc] # IPython is untyped here
        priority = 5  # before IPython's own ``!`` escape at the same place

        @classmethod
        def find(cls, tokens_by_line: list[list[Any]]) -> PipCommand | None:
            for line in tokens_by_line:
                first = next((tok for tok in line if tok.type not in (tokenize.INDENT, tokenize.DEDENT)), None)
                if first is not None and COMMAND.match(first.line, first.start[1]):
                    return cls(first.start)
            return None

        def transform(self, lines: list[str]) -> list[str]:
            start_line, start_col = self.start_line, self.start_col
            end_line = find_end_of_continued_line(lines, start_line)
            text = assemble_continued_line(lines, (start_line, start_col), end_line)
            found = COMMAND.match(text)
            args = text[found.end() :].strip() if found else text
            call = f"{lines[start_line][:start_col]}get_ipython().run_line_magic('pip', {args!r})\n"
            return [*lines[:start_line], call, *lines[end_line + 1 :]]

    return PipCommand


def install_magic(shell: Any) -> None:
    """Make ``%pip`` ours, and route the shell escapes and bare pip lines to it."""
    shell.register_magic_function(pip_magic, "line", "pip")
    shell.input_transformer_manager.token_transformers.insert(0, transformer())
