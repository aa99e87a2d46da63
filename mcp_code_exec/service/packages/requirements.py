"""A cell's ``pip install`` lines, read before it runs, and the server's policy on what they ask for.

Sandboxes have no network, so what a cell will install must be known, fetched and copied in before
any of it runs. The lines read here are those the sandbox's shell sends to its own ``%pip`` (see
``mcpx_agent/worker/packages.py``; a unit test holds the two together): ``%pip install``, ``!pip install``
(also ``!pip3``, ``!python -m pip``, ``!{sys.executable} -m pip``) and a bare ``pip install`` line,
at the start of a line that is not inside a string. Only names from the server's index are served,
with versions, extras and markers; options that point pip elsewhere (files, URLs, other indexes,
other install locations) are refused with a sentence that says so, before anything runs.
"""

from __future__ import annotations

import fnmatch
import re
import shlex
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass

from ...config.sections import PackageSettings
from ...errors import PackageError

# What pip takes for a local archive rather than a name (its own list, compared case-insensitively as
# it does, and a few it may learn).
ARCHIVE_SUFFIXES = (
    ".whl", ".zip", ".tar", ".tar.gz", ".tgz", ".tar.bz2", ".tbz", ".tbz2", ".tar.xz", ".txz", ".tlz", ".tar.lz",
    ".tar.lzma", ".tar.zst", ".tzst", ".egg",
)  # fmt: skip
PIP_LINE = re.compile(
    r"^[ \t]*(?:%pip|!\s*(?:pip3?|python3?\s+-m\s+pip|\{sys\.executable\}\s+-m\s+pip)|pip3?(?=[ \t]+[a-z]))"
    r"(?:[ \t]+(?P<args>.*))?$"
)
FLAGS = {
    "-q", "--quiet", "-v", "--verbose", "-U", "--upgrade", "--user", "--no-deps", "--pre", "--no-cache-dir",
    "--no-warn-script-location", "--force-reinstall", "--no-compile", "--disable-pip-version-check",
    "--no-input", "--no-color", "--no-warn-conflicts", "--upgrade-strategy", "--progress-bar",
}  # fmt: skip
TAKES_VALUE = {"--upgrade-strategy", "--progress-bar"}
SHORT_FLAGS = set("qvU")
REFUSED = {
    ("-e", "--editable"): "editable installs build from source",
    ("-r", "--requirement", "-c", "--constraint"): "files are not read before the run; list the names instead",
    ("-i", "--index-url", "--extra-index-url", "-f", "--find-links", "--no-index"): (
        "packages come from the server's own index only"
    ),
    ("-t", "--target", "--prefix", "--root", "--src", "--home"): "packages go into the session's own site directory",
}
MAX_REQUIREMENTS = 50
_NAME = r"[A-Za-z0-9](?:[A-Za-z0-9._-]*[A-Za-z0-9])?"
_ONE = r"(?:===|==|!=|~=|<=|>=|<|>)\s*[A-Za-z0-9.*+!_-]+"
REQUIREMENT = re.compile(
    rf"^(?P<name>{_NAME})\s*(?:\[\s*(?P<extras>(?:{_NAME}(?:\s*,\s*{_NAME})*)?)\s*\])?"
    rf"\s*(?P<spec>\(?\s*{_ONE}(?:\s*,\s*{_ONE})*\s*\)?)?\s*(?:;(?P<marker>[^@]*))?$"
)
URL_SCHEME = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:")
SHELL_SYNTAX = re.compile(r"^(?:[|;&<>]|\d+>)")  # ends pip's arguments (`> /dev/null 2>&1`); so in the agent
HINT = "name the packages, with versions if you like (`%pip install humanize==4.9`)"


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


@dataclass(frozen=True)
class PackageRequest:
    """What a cell (and run_python's ``packages``) asks to install."""

    requirements: tuple[str, ...]  # as pip reads them, each once, in a stable order
    names: tuple[str, ...]  # their project names, normalized
    pre: bool = False  # pre-releases allowed (--pre)

    @property
    def key(self) -> tuple[tuple[str, ...], bool]:
        return tuple(sorted(self.requirements)), self.pre


def prescan(code: str, extra: Sequence[str] = ()) -> PackageRequest | None:
    """The packages ``code``'s ``pip install`` lines ask for, with ``extra`` (run_python's
    ``packages``); None when there are none. PackageError for what is not served."""
    requirements: list[str] = [requirement(item) for item in extra]
    pre = False
    if "pip" in code:  # the common case costs one substring search
        for line in lines_outside_strings(code):
            found = PIP_LINE.match(line)
            if found is None:
                continue
            try:
                args = shlex.split(found.group("args") or "", comments=True)
            except ValueError as exc:
                raise PackageError(f"cannot read this pip line ({exc}): {line.strip()[:200]}") from None
            if args[:1] == ["install"]:
                cut = next((i for i, arg in enumerate(args) if SHELL_SYNTAX.match(arg)), len(args))
                wanted, wants_pre = install_arguments(args[1:cut])
                requirements += wanted
                pre = pre or wants_pre
    if not requirements:
        return None
    unique = tuple(dict.fromkeys(requirements))
    if len(unique) > MAX_REQUIREMENTS:
        raise PackageError(f"{len(unique)} packages in one run; at most {MAX_REQUIREMENTS}")
    names = tuple(dict.fromkeys(project_name(item) for item in unique))
    return PackageRequest(unique, names, pre)


def install_arguments(args: Sequence[str]) -> tuple[list[str], bool]:
    """The requirements of ``pip install ARGS``, and whether --pre was given."""
    wanted: list[str] = []
    pre = False
    skip_value = False
    for arg in args:
        if skip_value:
            skip_value = False
        elif arg.startswith("-"):
            option = arg.split("=", 1)[0]
            check_option(option)
            pre = pre or option == "--pre"
            skip_value = option in TAKES_VALUE and "=" not in arg
        else:
            wanted.append(requirement(arg))
    if not wanted:
        raise PackageError(f"`pip install` names no package: {HINT}")
    return wanted, pre


def check_option(option: str) -> None:
    for options, why in REFUSED.items():
        if option in options or any(option.startswith(short) for short in options if len(short) == 2):
            raise PackageError(f"`pip install {option}` is not supported here ({why}): {HINT}")
    short = option[1:] if not option.startswith("--") else ""
    if option not in FLAGS and not (short and set(short) <= SHORT_FLAGS):
        raise PackageError(f"`pip install {option}` is not supported here: {HINT}")


def requirement(text: str) -> str:
    """One requirement as given, checked: a name from the index, not a URL, a path or a variable."""
    text = text.strip()
    if "$" in text or "{" in text:
        raise PackageError(
            f"{text!r}: variables are not expanded before the run; write the package names in the pip line itself"
        )
    if "://" in text or "@" in text or re.match(r"^(git|hg|svn|bzr)\+", text) or URL_SCHEME.match(text):
        raise PackageError(f"{text!r}: installs from URLs are not supported; packages come from the server's index")
    if any(char in text for char in "/\\") or text.startswith((".", "~")) or names_an_archive(text):
        raise PackageError(f"{text!r}: installs from files or paths are not supported: {HINT}")
    if len(text) > 200 or REQUIREMENT.match(text) is None:
        raise PackageError(f"{text[:200]!r} is not a requirement pip understands: {HINT}")
    return text


def names_an_archive(text: str) -> bool:
    """pip would take ``text`` for a local archive (``x.tar``, ``x.ZIP``, ``x==1+a.whl``): what comes
    before a marker, with or without its extras, ends like one."""
    head = text.split(";", 1)[0].strip().lower()
    return any(part.endswith(ARCHIVE_SUFFIXES) for part in (head, re.sub(r"\[[^\]]*\]$", "", head).strip()))


def pip_form(requirement_text: str) -> str:
    """A checked requirement as it is handed to the host's pip: the normalized name (no dots, so
    nothing pip could take for a file), extras, specifiers without spaces, the marker; pip can
    read it only as a name to look up on its index."""
    found = REQUIREMENT.match(requirement_text)
    if found is None or names_an_archive(requirement_text):
        raise PackageError(f"{requirement_text[:200]!r} is not a requirement pip understands: {HINT}")
    text = normalize(found.group("name"))
    extras = [normalize(extra) for extra in re.split(r"\s*,\s*", (found.group("extras") or "").strip()) if extra]
    if extras:
        text += "[" + ",".join(extras) + "]"
    text += re.sub(r"[\s()]", "", found.group("spec") or "")
    if names_an_archive(text) or text.startswith((".", "-")):  # pragma: no cover - held by the checks above
        raise PackageError(f"{requirement_text[:200]!r} is not a requirement pip understands: {HINT}")
    marker = (found.group("marker") or "").strip()
    return f"{text}; {marker}" if marker else text


def project_name(requirement_text: str) -> str:
    found = REQUIREMENT.match(requirement_text)
    assert found is not None  # checked by requirement()
    return normalize(found.group("name"))


def lines_outside_strings(code: str) -> Iterator[str]:
    """The lines of ``code`` that do not start inside a triple-quoted string."""
    quote: str | None = None
    for line in code.splitlines():
        if quote is None:
            yield line
        quote = open_quote_after(line, quote)


def open_quote_after(line: str, quote: str | None) -> str | None:
    """The triple quote still open at the end of ``line``, given the one open at its start."""
    i = 0
    while i < len(line):
        char = line[i]
        if quote is not None:
            if char == "\\":
                i += 2
            elif line.startswith(quote, i):
                i, quote = i + 3, None
            else:
                i += 1
        elif char == "#":
            break
        elif char in "'\"":
            if line.startswith(char * 3, i):
                i, quote = i + 3, char * 3
                continue
            i += 1  # a one-line string ends on its line (or the code does not parse anyway)
            while i < len(line) and line[i] != char:
                i += 2 if line[i] == "\\" else 1
            i += 1
        else:
            i += 1
    return quote


# -- policy ------------------------------------------------------------------------------------
def check_requested(names: Iterable[str], settings: PackageSettings) -> None:
    """Refuse what the server does not install at all, before anything is resolved."""
    if not settings.enabled:
        raise PackageError(
            "package installs are disabled on this server ([packages] enabled = false); "
            "use the preinstalled libraries, or ask the operator for an image with the package"
        )
    for name in names:
        if settings.allow and not matches(name, settings.allow):
            raise PackageError(f"{name} is not among the packages this server installs ([packages] allow)")
    check_denied(names, settings)


def check_denied(names: Iterable[str], settings: PackageSettings, *, wanted_by: str = "") -> None:
    """Refuse a denied package, asked for or (``wanted_by``) pulled in as a dependency."""
    for name in names:
        if matches(name, settings.deny):
            why = f" (a dependency of {wanted_by})" if wanted_by else ""
            raise PackageError(f"{name}{why} is denied by this server's policy ([packages] deny)")


def matches(name: str, patterns: Iterable[str]) -> bool:
    return any(fnmatch.fnmatchcase(name, normalize(pattern)) for pattern in patterns)
