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
    import matplotlib.pyplot  # noqa: F401
    import numpy  # noqa: F401
    import pandas

    pandas.set_option("display.max_rows", 20)
    pandas.set_option("display.min_rows", 10)
    pandas.set_option("display.max_columns", 20)
    pandas.set_option("display.width", 120)

    from .shell import make_shell

    return make_shell()


def main() -> int:
    from .supervisor import Supervisor, take_channel

    chan_in, chan_out = take_channel()
    shell = preload()
    Supervisor(shell, chan_in, chan_out).serve()  # type: ignore[arg-type]
    return 0


if __name__ == "__main__":
    if os.getpid() == 1:
        sys.stderr.write("mcpx_agent must run under an init (docker run --init)\n")
    sys.exit(main())
