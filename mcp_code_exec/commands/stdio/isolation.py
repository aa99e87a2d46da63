"""The host's own Python processes never import what a sandbox wrote (docs/security.md, "Code
planted for the host's Python").

Standard library only: the front imports it.

A sandbox writes into the directories ``[[mounts]]`` shares writable, and Python looks for a module
in the directories of its import path before the standard library's and the installed packages':
the directory ``python -m`` or ``python -c`` was started in, a script's directory, ``PYTHONPATH``.
A ``netrc.py``, ``docker.py`` or ``mcp_code_exec/`` planted in one of those runs on the host as the
server's user, with its environment, when the host next imports that name. So:

- every Python the server starts (the local service; the benchmark's servers) runs isolated
  (``-I``: neither its working directory nor the user's site directory nor ``PYTHON*`` variables
  reach its path), in a private working directory, with the import path of the process that starts
  it given explicitly, without the directories that process was started from (``service_command``);
- the front, and every process that loads the configuration, refuses a writable mount that holds
  the directory it was started in or a directory of its import path (``config.mounts``).
"""

from __future__ import annotations

import json
import os
import sys
from collections.abc import Mapping, Sequence
from pathlib import Path

from ...config import greeting
from ...config.mounts import running_refusal
from .local_service import LocalServiceError

PACKAGE_HOME = Path(__file__).resolve().parents[3]  # the directory this package was imported from
# What the isolated interpreter runs: this package's command line, with the import path it is given
# (the interpreter's own entries, which the given path holds too, are kept after it).
BOOTSTRAP = (
    "import json, sys\n"
    "given = json.loads(sys.argv.pop(1))\n"
    "sys.path[:] = given + [entry for entry in sys.path if entry not in given]\n"
    "from mcp_code_exec.commands.cli import main\n"
    "sys.exit(main())\n"
)


def service_command(args: Sequence[str], started_in: str | None) -> list[str]:
    """``mcp-code-exec ARGS`` as a new interpreter, isolated (``-I``), with this process's import
    path but for the directories it was started from (see ``import_path``). ``-I`` alone would also
    drop ``PYTHONPATH`` and the user's site directory, where a ``pip install --user`` or a source
    checkout on ``PYTHONPATH`` put the package and its dependencies; giving the path keeps every way
    of installing it working (a virtual environment, ``pip install .`` or ``-e .``, ``--user``)."""
    return [sys.executable, "-I", "-c", BOOTSTRAP, json.dumps(import_path(started_in)), *args]


def import_path(started_in: str | None) -> list[str]:
    """This process's import path without the directories it was started from: ``started_in`` (the
    working directory ``python -m`` puts first) and its script's directory (a console script's).
    The directory this package was imported from stays, first if it was one of those (a source
    checkout run from its root): the service must run the very code the front runs (its files are
    named after the package's path, ``local_service.build_parts``); a writable mount may not hold it."""
    script = os.path.dirname(os.path.realpath(sys.argv[0])) if sys.argv and sys.argv[0] else None
    started = {os.path.realpath(place) for place in (started_in, script) if place}
    home = os.fspath(PACKAGE_HOME)
    kept = [
        entry
        for entry in sys.path
        if os.path.isabs(entry) and (os.path.realpath(entry) not in started or os.path.realpath(entry) == home)
    ]
    return kept if any(os.path.realpath(entry) == home for entry in kept) else [home, *kept]


def leave_the_client(
    directory: Path, parsed: dict[str, object] | None, config: str | None, environ: Mapping[str, str]
) -> str | None:
    """Make ``directory`` (the service's own, private) the front's working directory, and return the
    one it was started in (its client's; None: removed since), once the configuration ``parsed``
    has been checked against it (``refuse_writable_start``)."""
    try:
        started_in: str | None = os.getcwd()
    except OSError:
        started_in = None
    os.chdir(directory)
    if parsed is not None:
        refuse_writable_start(greeting.from_file(parsed, environ=environ, config_file=config), config, started_in)
    return started_in


def refuse_writable_start(found: greeting.Greeting | None, config: str | None, started_in: str | None) -> None:
    """Raise (exit 2, as for a configuration the service refuses) when a writable mount holds the
    directory the front was started in or a directory of its import path. The service, loading the
    configuration, checks its own (``config.mounts.writable_refusal``); only the front knows its
    client's directory, and a front may join a service another front started elsewhere. ``found``
    None: the file is not plainly valid, and the service says what is wrong with it."""
    for index, mount in enumerate(found.mounts if found is not None else ()):
        why = running_refusal(Path(mount.path), started_in, sys.path) if mount.writable else None
        if why is not None:
            raise LocalServiceError(f"{config or 'configuration'}: mounts[{index}].writable: {why}", 2)
