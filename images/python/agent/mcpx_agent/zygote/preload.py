"""What the zygote loads before it forks: the notebook libraries, warmed, and the shell every worker runs.

``load_libraries`` is the whole of it, which the image build (``bundle``) calls to learn which
modules to write into the preload bundle. The agent's start (``__main__``) loads it in two steps:
the core and the shell (``preload_core``), at which point the lean zygote forks off (see ``lean``),
then the data libraries (``preload_data_libraries``).
"""

from __future__ import annotations

import importlib
import importlib.util
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


class DeferredModule(types.ModuleType):
    """Stands in for a module in ``sys.modules`` and imports the real one when first used.

    (The stdlib's ``LazyLoader`` does not fit: the import statement itself reads ``__spec__``,
    which makes it load at once.)
    """

    def __getattr__(self, name: str) -> Any:
        if name.startswith("__"):  # the import system probes __spec__, __path__ and the like
            raise AttributeError(name)
        return getattr(self.load(), name)

    def load(self) -> types.ModuleType:
        if sys.modules.get(self.__name__) is self:
            del sys.modules[self.__name__]
        return importlib.import_module(self.__name__)


def defer(name: str) -> DeferredModule:
    stub = DeferredModule(name)
    sys.modules[name] = stub
    return stub


# What ``import IPython`` loads that a sandbox cell almost never reaches: the terminal front end
# (prompt_toolkit; cells run in the core InteractiveShell), verbose tracebacks (stack_data) and
# pexpect-driven shell commands. About 13 MB of heap that would be resident in every warm
# container and mapped into every forked run; each now loads on first use, in the worker.
DEFERRED_MODULES = ("stack_data", "pexpect")


def import_ipython_core() -> None:
    """Import IPython with its rarely used parts deferred, and without jedi (completion only)."""
    if "IPython" in sys.modules:
        return
    for name in DEFERRED_MODULES:
        if importlib.util.find_spec(name) is not None:
            defer(name)
    terminal = defer("IPython.terminal.embed")
    # IPython/__init__ imports this one name from it; the real module is imported when it is called.
    terminal.embed = lambda **kwargs: terminal.load().embed(**kwargs)  # type: ignore[attr-defined]
    blocked = "jedi" not in sys.modules
    if blocked:
        sys.modules["jedi"] = None  # type: ignore[assignment] # the completer then runs without it
    try:
        import IPython.core.completer  # imports jedi when it can: here it cannot
        import IPython.core.interactiveshell  # noqa: F401
    finally:
        if blocked:
            del sys.modules["jedi"]  # user code may still import jedi itself


def preload_core() -> None:
    """What every worker needs, the lean zygote's whole heap: IPython's core shell and the agent."""
    from ..worker import worker  # noqa: F401

    import_ipython_core()
    private_dirs()
    # plotly 6 warns at every export that kaleido 0.2.1 is old; it is the one that exports offline
    # (it brings its own headless Chromium), so the warning tells a user nothing they can act on.
    import warnings

    old_kaleido = r"\s*Support for Kaleido versions less than 1"
    warnings.filterwarnings("ignore", message=old_kaleido, category=DeprecationWarning)


def preload_data_libraries(shell: Any) -> None:
    """Import the heavy libraries once, so every forked run of the full zygote starts with them
    ready; then settle ``shell``, made before them, and warm their caches."""
    import linecache

    import matplotlib

    from ..worker.shell import settle_shell

    # Importing pyparsing (for matplotlib) reads a 7000-line source of its own into linecache,
    # about 0.5 MB of strings: freed here, the imports below reuse the space instead of adding to it.
    linecache.clearcache()
    configure_matplotlib(matplotlib)
    import matplotlib.pyplot
    import numpy  # noqa: F401
    import pandas

    configure_pandas(pandas)
    try:
        from kaleido.scopes import base
    except ImportError:
        pass
    else:
        configure_kaleido(base)
    settle_shell(shell)
    warm_caches()


def configure_matplotlib(matplotlib: Any) -> None:
    matplotlib.use("Agg")


def configure_pandas(pandas: Any) -> None:
    pandas.set_option("display.max_rows", 20)
    pandas.set_option("display.min_rows", 10)
    pandas.set_option("display.max_columns", 20)
    pandas.set_option("display.width", 120)


def configure_kaleido(base: Any) -> None:
    # Kaleido's Chromium in one process: its usual process tree of zygote, renderer and GPU
    # helpers, each with dozens of threads, runs into the sandbox's pids limit under load and then
    # hangs (a known kaleido 0.2.1 failure); this is the mode it uses on AWS Lambda for the same reason.
    base.BaseScope._default_chromium_args = (*base.BaseScope._default_chromium_args, "--single-process")


def configure_pyplot(pyplot: Any) -> None:
    from ..worker.shell import adopt_pyplot

    adopt_pyplot(pyplot)


def configure_numpy(numpy: Any) -> None:
    from IPython.core.getipython import get_ipython

    from ..worker.shell import add_float64_printer

    shell = get_ipython()
    if shell is not None:
        add_float64_printer(shell, numpy)


# What a lean worker does to a data library it imports itself, so that it behaves as the full
# zygote's preloaded one does (see ``lean``).
CONFIGURE_ON_IMPORT = {
    "numpy": configure_numpy,
    "matplotlib": configure_matplotlib,
    "matplotlib.pyplot": configure_pyplot,
    "pandas": configure_pandas,
    "kaleido.scopes.base": configure_kaleido,
}


def preload() -> object:
    """Every library the zygote loads, and the shell: the full zygote's heap."""
    from ..worker.shell import make_shell

    preload_core()
    shell = make_shell()
    preload_data_libraries(shell)
    return shell


def warm_caches() -> None:
    """Fill the libraries' lazy caches (fonts, glyphs, formatters) once, before any fork.

    Only objects of our own are made (a Figure that pyplot never sees), so no user-visible state
    changes; every forked run then finds the caches ready instead of building them again.
    """
    import pandas
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    from ..worker.figures import render_png

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
    # matplotlib empties its font cache in every forked child (the fonts hold file descriptors
    # a child cannot share), and freeing the cached fonts there writes to hundreds of pages that
    # the fork had shared: about 115 page copies per run. Emptied here, once, there is nothing to free.
    clear_fonts = getattr(sys.modules.get("matplotlib.font_manager"), "_get_font", None)
    if clear_fonts is not None and hasattr(clear_fonts, "cache_clear"):
        clear_fonts.cache_clear()


def load_libraries() -> object:
    """Everything the zygote imports before it forks; the image build's bundle holds the same."""
    from ..worker import worker  # noqa: F401

    return preload()
