"""Host directories the user mounts into sandboxes (``[[mounts]]``): which may be, and where.

Only the user's configuration names them, never the model. Each is checked when the configuration
loads: its path must be absolute (after ``~``), exist and be a directory; it is resolved once,
here, so what the engine mounts is what was checked; and it may neither lie inside nor contain a
place that would hand a sandbox the host: the kernel's pseudo-filesystems, system configuration,
the engine's state and sockets, credentials, the server's own configuration, pip's configuration
(it may hold an index's credentials, and the host's pip reads it). A writable mount may moreover
neither lie inside nor contain what the host runs or trusts: the server's code, its Python (the
interpreter's libraries, site and user-site directories, where a planted ``.pth`` file runs at every
start, and its script directories), the shared wheel cache; nor contain the temporary directory
where the host's pip works, the directory the server was started in, or any directory its Python
imports modules from (a module planted there would be imported by the host: see ``running_refusal``).
"""

from __future__ import annotations

import os
import site
import sys
import sysconfig
import tempfile
from collections.abc import Iterable, Mapping
from pathlib import Path

MOUNT_ROOT = "/mnt/host"  # a mount named "data" is /mnt/host/data in every sandbox
NAME_PATTERN = r"[a-z0-9][a-z0-9_-]{0,31}"
NAME_RULE = "1 to 32 of a-z, 0-9, _ and -, starting with a letter or digit"
MAX_MOUNTS = 16

# Never mounted, nor anything inside them, nor anything that contains them.
SYSTEM_TREES = (
    "/proc",
    "/sys",
    "/dev",
    "/etc",
    "/boot",
    "/run",  # the engine's socket (/run/docker.sock), rootless engines' (/run/user/<uid>)
    "/var/run",
    "/var/lib/docker",  # every container's filesystem and every volume
    "/var/lib/containerd",
    "/var/lib/containers",  # Podman's
    "/private/etc",  # macOS: /etc and /var/run resolve here
    "/private/var/run",
)
# The same, under the home directory: engine sockets and state (Docker Desktop, Colima, OrbStack,
# rootless Docker and Podman) and credentials. So the home directory itself cannot be mounted.
HOME_TREES = (
    ".docker",
    ".colima",
    ".orbstack",
    ".local/share/docker",
    ".local/share/containers",
    ".ssh",
    ".gnupg",
)


PACKAGE_DIR = Path(__file__).resolve().parents[1]
PIP_HOME_FILES = (".config/pip", ".pip", ".netrc")  # pip's configuration and the index credentials it reads


class MountRefused(ValueError):
    """A host directory that cannot be mounted; the message says why."""


def target(name: str) -> str:
    return f"{MOUNT_ROOT}/{name}"


def host_directory(raw: str, *, environ: Mapping[str, str], config_file: str | None = None) -> Path:
    """The resolved directory ``raw`` names, or ``MountRefused`` saying what is wrong with it."""
    try:
        path = Path(raw).expanduser()
    except RuntimeError:
        raise MountRefused(f"{raw!r}: cannot expand '~' (no home directory is known)") from None
    if not path.is_absolute():
        raise MountRefused(f"{raw!r} is not an absolute path (start it with / or ~/)")
    try:
        resolved = path.resolve(strict=True)
    except FileNotFoundError:
        raise MountRefused(f"{raw!r} does not exist") from None
    except (OSError, RuntimeError) as exc:  # a symlink loop, no permission to look
        raise MountRefused(f"{raw!r} cannot be resolved ({exc})") from None
    if not resolved.is_dir():
        raise MountRefused(f"{raw!r} is not a directory")
    shown = raw if str(resolved) == raw else f"{raw!r} (resolved: {resolved})"
    if resolved == Path(resolved.anchor):
        raise MountRefused(f"{shown} is the root directory; mount the directory that holds your data")
    for tree in protected_trees(environ, config_file):
        if resolved == tree:
            raise MountRefused(f"{shown} is a place sandboxes must never see")
        if tree in resolved.parents:
            raise MountRefused(f"{shown} is inside {tree}, which sandboxes must never see")
        if resolved in tree.parents:
            raise MountRefused(f"{shown} contains {tree}, which sandboxes must never see; mount a narrower directory")
    return resolved


def protected_trees(environ: Mapping[str, str], config_file: str | None = None) -> list[Path]:
    """Every path a mount may neither be in nor contain, as written and resolved."""
    paths = [Path(tree) for tree in SYSTEM_TREES]
    try:
        home = Path.home()
    except RuntimeError:
        home = None
    if home is not None:
        paths += [home / tree for tree in HOME_TREES]
        paths += [home / tree for tree in PIP_HOME_FILES]
    paths += pip_configuration(environ)
    paths += [socket_place(socket) for socket in engine_sockets([environ.get("DOCKER_HOST")])]
    if config_file:
        paths.append(Path(config_file).absolute())  # it may hold tokens, and it says what is mounted
    both = [Path(os.path.realpath(path)) for path in paths] + [path.absolute() for path in paths]
    return list(dict.fromkeys(both))  # in the order above, the first a path meets is the one named


def pip_configuration(environ: Mapping[str, str]) -> list[Path]:
    """Where the host's pip finds its configuration and credentials, as named by the environment
    (besides ~/.config/pip, ~/.pip, ~/.netrc and /etc)."""
    named = [environ.get("PIP_CONFIG_FILE"), environ.get("NETRC")]
    if environ.get("XDG_CONFIG_HOME"):
        named.append(os.path.join(environ["XDG_CONFIG_HOME"], "pip"))
    named += [os.path.join(tree, "pip") for tree in environ.get("XDG_CONFIG_DIRS", "").split(os.pathsep) if tree]
    return [Path(path).expanduser() for path in named if path and os.path.isabs(os.path.expanduser(path))]


def default_wheel_cache(environ: Mapping[str, str]) -> Path:
    """The wheel cache when ``[packages] cache_dir`` names none."""
    base = environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mcp-code-exec" / "wheels"


def wheel_cache(configured: str | None, environ: Mapping[str, str]) -> Path:
    return Path(os.path.expanduser(configured)) if configured else default_wheel_cache(environ)


def host_code() -> list[Path]:
    """What the host runs: the server's code and its Python (the interpreter's prefixes, libraries,
    site directories and script directories, the user's site and script directories), resolved.
    The user's are there even where this process does not use them (the local service runs with
    ``-I``): the stdio front, started by a client, does."""
    trees = [PACKAGE_DIR, Path(sys.prefix), Path(sys.exec_prefix), Path(site.getusersitepackages())]
    for scheme_vars in ({}, {"base": sys.base_prefix, "platbase": sys.base_exec_prefix}):
        found = sysconfig.get_paths(vars=scheme_vars) if scheme_vars else sysconfig.get_paths()
        keys = ("stdlib", "platstdlib", "purelib", "platlib", "scripts")
        trees += [Path(found[key]) for key in keys if key in found]
    trees.append(Path(sysconfig.get_paths(scheme=sysconfig.get_preferred_scheme("user"))["scripts"]))
    trees += [Path(path) for path in site.getsitepackages()]
    return list(dict.fromkeys(Path(os.path.realpath(tree)) for tree in trees))


def writable_refusal(path: Path) -> str | None:
    """Why ``path`` cannot be a writable mount, or None: what a sandbox writes there must never be
    code the host runs or imports (here: this process, in the directory it runs in), nor reach the
    place the host's pip works in (the wheel cache: see ``cache_refusal``)."""
    for tree in host_code():
        if overlap(path, tree):
            return f"{path} overlaps {tree}, the server's own code or its Python; it cannot be writable"
    try:
        here: str | None = os.getcwd()
    except OSError:  # removed since: nothing is found there any more
        here = None
    why = running_refusal(path, here, sys.path)
    if why is not None:
        return why
    temporary = Path(os.path.realpath(tempfile.gettempdir()))
    if path == temporary or path in temporary.parents:
        return f"{path} contains {temporary}, where the host's pip works; it cannot be writable"
    return None


def running_refusal(path: Path, started_in: str | None, import_path: Iterable[str]) -> str | None:
    """Why ``path`` cannot be writable for a Python process started in ``started_in`` with the
    import path ``import_path``, or None. A module a sandbox writes into a directory of the import
    path is imported by the host in place of the one it names (``json``, ``netrc``, the server's own
    package), as the server's user, with its environment; and ``python -m`` (without ``-I`` or
    ``-P``) looks in the directory it was started in first, before any code of ours runs. A mount
    that lies inside such a directory only adds names under its own, which nothing imports."""
    if started_in:
        start = Path(os.path.realpath(started_in))
        if path == start or path in start.parents:
            return (
                f"{path} holds {start}, the directory the server was started in; it cannot be writable "
                "(start the server in another directory, or mount this one read-only)"
            )
    for entry in import_path:
        if not os.path.isabs(entry):
            continue  # '' (the working directory, above)
        place = Path(os.path.realpath(entry))
        if path == place or path in place.parents:
            return f"{path} holds {place}, a directory the server's Python imports modules from; it cannot be writable"
    return None


def cache_refusal(path: Path, cache: Path) -> str | None:
    """Why ``path`` cannot be a writable mount beside the wheel cache ``cache``, or None: a wheel
    planted or swapped there would go into other sandboxes."""
    for tree in dict.fromkeys((cache.absolute(), Path(os.path.realpath(cache)))):
        if overlap(path, tree):
            return f"{path} overlaps the wheel cache {tree}, shared by every sandbox; it cannot be writable"
    return None


def socket_place(socket: Path) -> Path:
    """What a mount may neither be, hold nor lie in for the engine's socket ``socket``: its
    directory (the engine makes the socket anew there); the socket itself when that directory is
    the root, inside which every directory lies (and which no mount may be)."""
    return socket if socket.parent == Path(socket.anchor) else socket.parent


def engine_sockets(endpoints: Iterable[str | None]) -> list[Path]:
    """The unix sockets among engine endpoints (``unix:///run/docker.sock``), resolved."""
    return [
        Path(os.path.realpath(endpoint.removeprefix("unix://")))
        for endpoint in endpoints
        if endpoint and endpoint.startswith("unix://")
    ]


def overlap(first: Path, second: Path) -> bool:
    """One directory is, or is inside, the other. A writable mount holding another's source could
    swap that source for a symlink, which the engine would follow at the next container start."""
    return first == second or first in second.parents or second in first.parents
