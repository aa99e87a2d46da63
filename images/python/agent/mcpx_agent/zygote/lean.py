"""The lean zygote: a second zygote whose heap holds IPython's core and the agent, and none of the
data libraries, for the stateless cells that import none of them.

Forking the full zygote's 74 MiB heap and ending the child cost a run 6.5-8.5 ms of CPU before the
worker does anything, and its worker copies more pages as it runs. A cell such as ``print(1+1)``
needs none of that heap. So the agent's first process, once IPython's core is loaded, forks this
one off before it goes on to import numpy, pandas and matplotlib::

    agent (IPython core) --fork--> lean zygote --fork--> lean workers
        |  imports the data libraries
        +--fork--> supervisor (orders workers of either zygote, over a socket each)
        +--------> full workers

The supervisor picks the zygote by a static look at the cell (``supervisor.routing``). A lean worker
runs any cell: one that imports a data library after all (by ``exec``, say) pays for the import, and
holds the library's memory as its own rather than sharing the zygote's (so it reaches the memory
limit sooner); the library is set up as the preloaded one is (``ConfigureOnImport``), except that
matplotlib, imported with the sandbox's environment and directory, builds its font cache in /tmp.

It costs memory: the pages of the core that the first process goes on to write while importing the
data libraries are copied, and the lean zygote keeps the originals: about 10 MiB more per warm container
(the full zygote does not collapse the ranges it shares with the lean one into huge pages: see ``hugepages``).

The lean zygote is a zygote like the other (``zygote.serve``): it has never held anything of a run,
and it drops to the zygote's uids. It keeps none of the descriptors its parent holds for the host.
"""

from __future__ import annotations

import contextlib
import gc
import importlib.abc
import os
import socket
import sys
from collections.abc import Callable, Sequence
from types import ModuleType
from typing import Any


class ConfigureOnImport(importlib.abc.MetaPathFinder):
    """Runs a set-up function after a module's first import (the finders after this one find it)."""

    def __init__(self, hooks: dict[str, Callable[[Any], None]]) -> None:
        self.hooks = dict(hooks)

    def find_spec(self, fullname: str, path: Sequence[str] | None, target: ModuleType | None = None) -> Any:
        hook = self.hooks.get(fullname)
        if hook is None:
            return None
        spec = None
        for finder in sys.meta_path[sys.meta_path.index(self) + 1 :] if self in sys.meta_path else ():
            find = getattr(finder, "find_spec", None)
            spec = find(fullname, path, target) if find is not None else None
            if spec is not None:
                break
        loader = getattr(spec, "loader", None)
        if loader is None or not hasattr(loader, "exec_module"):
            return spec
        run_module = loader.exec_module

        def exec_module(module: ModuleType) -> None:
            run_module(module)
            if self.hooks.pop(fullname, None) is None:
                return  # set up already, by another import of the same name
            if not self.hooks:
                with contextlib.suppress(ValueError):
                    sys.meta_path.remove(self)
            with contextlib.suppress(Exception):  # the library works unconfigured: a difference in display only
                hook(module)

        loader.exec_module = exec_module
        return spec


def start(shell: Any, keep: socket.socket, close: Sequence[int]) -> int:
    """Fork the lean zygote, which serves ``keep``'s orders; its pid. ``close``: the descriptors
    of ours it must not hold (the host channel, the other zygote's socket)."""
    pid = os.fork()
    if pid:
        keep.close()
        return pid
    code = 1
    try:
        for fd in close:
            with contextlib.suppress(OSError):
                os.close(fd)
        serve(shell, keep)
        code = 0
    except BaseException:  # noqa: BLE001 - said on stderr; the supervisor then ends, and the container is replaced
        import traceback

        traceback.print_exc()
    finally:
        os._exit(code)


def serve(shell: Any, sock: socket.socket) -> None:
    from .. import relay
    from ..worker.worker import prepare_environment
    from . import preload, zygote

    relay.forget_key_fd()  # the supervisor's alone, as in the full zygote
    sys.meta_path.insert(0, ConfigureOnImport(preload.CONFIGURE_ON_IMPORT))
    prepare_environment()
    gc.collect()  # the young objects only: what the parent loaded was frozen before the fork
    gc.freeze()
    zygote.serve(shell, sock)
