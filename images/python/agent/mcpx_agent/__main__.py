"""Entry point of the in-container agent: ``python3 -m mcpx_agent``."""

from __future__ import annotations

import os
import sys

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


def preload() -> object:
    """Import the heavy libraries once, so every forked run starts with them ready."""
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
    import io

    import pandas
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure

    try:
        figure = Figure(figsize=(2, 1.5))
        FigureCanvasAgg(figure)
        axes = figure.add_subplot()
        axes.plot([0, 1], [1, 0])
        axes.set_title("warm")
        figure.savefig(io.BytesIO(), format="png", bbox_inches="tight", pil_kwargs={"compress_level": 1})
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
