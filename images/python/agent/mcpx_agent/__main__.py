"""Entry point of the in-container agent: ``python3 -m mcpx_agent``."""

from __future__ import annotations

import importlib
import os
import sys
import types
from typing import Any

PRIVATE_DIR = "/run/mcpx"  # a root-only tmpfs: the supervisor's caches stay out of user-visible /tmp


def private_dirs() -> None:
    """Give matplotlib and IPython writable homes, seeded from the caches baked into the image."""
    import shutil

    try:
        os.makedirs(f"{PRIVATE_DIR}/mpl", exist_ok=True)
        os.makedirs(f"{PRIVATE_DIR}/ipython", exist_ok=True)
    except OSError:
        return
    baked = os.environ.get("MPLCONFIGDIR", "/opt/mcpx/mplconfig")
    if os.path.isdir(baked):
        shutil.copytree(baked, f"{PRIVATE_DIR}/mpl", dirs_exist_ok=True)
    os.environ["MPLCONFIGDIR"] = f"{PRIVATE_DIR}/mpl"
    os.environ["IPYTHONDIR"] = f"{PRIVATE_DIR}/ipython"


TERMINAL_EMBED = "IPython.terminal.embed"


class _DeferredTerminal(types.ModuleType):
    """Stands in for ``IPython.terminal.embed`` until something really uses it.

    ``import IPython`` imports the terminal front end (prompt_toolkit and, through the completer,
    jedi): about 11 MB of heap a sandbox never uses, since cells run through the core
    ``InteractiveShell``. That heap would be resident in every warm container and copied into
    the page tables of every forked run. The first use of anything here imports the real module.
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # the import system probes __path__ and the like
            raise AttributeError(name)
        return getattr(_real_terminal_embed(), name)


def _real_terminal_embed() -> types.ModuleType:
    if isinstance(sys.modules.get(TERMINAL_EMBED), _DeferredTerminal):
        del sys.modules[TERMINAL_EMBED]
    return importlib.import_module(TERMINAL_EMBED)


def _embed(**kwargs: Any) -> Any:
    return _real_terminal_embed().embed(**kwargs)


def import_ipython_core() -> None:
    """Import IPython without its terminal front end and without jedi (see ``_DeferredTerminal``)."""
    if "IPython" in sys.modules:
        return
    stub = _DeferredTerminal(TERMINAL_EMBED)
    stub.embed = _embed  # type: ignore[attr-defined] # what IPython/__init__ imports from it
    sys.modules[TERMINAL_EMBED] = stub
    blocked = "jedi" not in sys.modules
    if blocked:
        sys.modules["jedi"] = None  # type: ignore[assignment] # the completer then runs without it
    try:
        import IPython.core.completer  # imports jedi when it can: here it cannot
        import IPython.core.interactiveshell  # noqa: F401
    finally:
        if blocked:
            del sys.modules["jedi"]  # user code may still import jedi itself


def preload() -> object:
    """Import the heavy libraries once, so every forked run starts with them ready."""
    import_ipython_core()
    private_dirs()
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot
    import numpy  # noqa: F401
    import pandas

    pandas.set_option("display.max_rows", 20)
    pandas.set_option("display.min_rows", 10)
    pandas.set_option("display.max_columns", 20)
    pandas.set_option("display.width", 120)

    from .shell import make_shell

    shell = make_shell()
    warm_caches()
    return shell


def warm_caches() -> None:
    """Fill the libraries' lazy caches (fonts, glyphs, formatters) once, before any fork.

    Only objects of our own are made (a Figure that pyplot never sees), so no user-visible state
    changes; every forked run then finds the caches ready instead of building them again.
    """
    import pandas
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from .figures import render_png

    try:
        figure = Figure(figsize=(2, 1.5))
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        axes.plot([0, 1], [1, 0])
        axes.set_title("warm")
        render_png(figure)
        frame = pandas.DataFrame({"a": [1.5, 2.0], "b": ["x", "y"]})
        repr(frame)
        frame._repr_html_()
    except Exception:  # noqa: BLE001, S110 - an optimisation only
        pass


def release_free_memory() -> None:
    """Hand the heap's free pages back to the kernel (the imports leave megabytes of them)."""
    import contextlib
    import ctypes

    with contextlib.suppress(OSError, AttributeError):  # not glibc
        ctypes.CDLL(None).malloc_trim(0)


def main() -> int:
    import_ipython_core()  # before anything imports IPython (the supervisor imports the shell)
    from .supervisor import Supervisor, take_channel

    chan_in, chan_out = take_channel()
    shell = preload()
    import gc

    # Everything loaded so far lives as long as we do: keep the collector away from it, so a
    # collection in a forked worker does not write to (and copy) every page of the heap.
    gc.collect()
    gc.freeze()
    release_free_memory()
    Supervisor(shell, chan_in, chan_out).serve()  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    if os.getpid() == 1:
        sys.stderr.write("mcpx_agent must run under an init (docker run --init)\n")
    sys.exit(main())
