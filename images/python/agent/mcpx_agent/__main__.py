"""Entry point of the in-container agent: ``python3 -m mcpx_agent``."""

from __future__ import annotations

import os
import sys
from typing import Any, NamedTuple


class LeanZygote(NamedTuple):
    """The lean zygote as started: the supervisor's socket to it, its pid, and our maps as it forked
    (the heap it shares: see ``collapse_heap``)."""

    socket: Any
    pid: int
    maps_at_fork: str


def release_free_memory() -> None:
    """Hand the heap's free pages back to the kernel (the imports leave megabytes of them)."""
    import contextlib

    from .identity import LIBC

    with contextlib.suppress(OSError, AttributeError):  # not glibc
        LIBC.malloc_trim(0)


def main() -> int:
    """Load the libraries and split into the supervisor (which talks to the host) and the zygote
    (this process, which forks the workers; see ``zygote``).

    The split comes after the imports: the supervisor then shares the libraries' pages and copies
    the few hundred it writes (3.5 MB, against 4.6 for an interpreter split off before them, whose
    pages the zygote's imports went on to copy). Under gVisor, whose kernel copies private memory
    in much larger pieces than a page, sharing the heap would cost most of a second copy (+60 MiB):
    there the host asks for the split before the imports (``MCPX_SPLIT_BEFORE_IMPORTS``).
    """
    import contextlib
    import gc
    import socket

    # The container starts in /mnt/data, which in a session holds the user's files: nothing there may
    # shape the zygote (matplotlib, for one, reads a matplotlibrc from the working directory).
    # Workers go back to /mnt/data.
    os.chdir("/")
    egress_socket = os.environ.get("MCPX_EGRESS_SOCKET")
    if egress_socket:  # before anything else: no user code may run before it holds its port
        from .relay import start as start_relay
        from .supervisor import processes

        relay = start_relay(egress_socket)
        if relay is not None:
            processes.KEPT_PIDS.add(relay)
    from .supervisor.supervisor import take_channel
    from .zygote import bundle, preload

    chan_in, chan_out = take_channel()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    split_first = os.environ.get("MCPX_SPLIT_BEFORE_IMPORTS") == "1"
    if split_first:
        # What both hold so far stays shared: kept away from the collector, whose bookkeeping
        # writes would copy every page it walks.
        gc.collect()
        gc.freeze()
        start_supervisor(ours, theirs, None, chan_in, chan_out)
    from .worker.shell import make_shell

    with bundle.Bundle.open() or contextlib.nullcontext():  # see ``bundle``
        preload.preload_core()
        shell = make_shell()
    lean = None if split_first else start_lean_zygote(shell, [chan_in, chan_out, ours.fileno(), theirs.fileno()])
    with bundle.Bundle.open() or contextlib.nullcontext():
        preload.preload_data_libraries(shell)
    from .worker.worker import prepare_environment

    prepare_environment()  # after the imports, which read the container's environment
    freeze_heap()
    from .zygote.hugepages import collapse_heap

    collapse_heap(lean.maps_at_fork if lean else "")  # fewer page-table entries to copy at each fork and exit
    if not split_first:
        start_supervisor(ours, theirs, lean, chan_in, chan_out)
    from .zygote import zygote

    zygote.serve(shell, theirs)
    return 0


def freeze_heap() -> None:
    """Everything loaded so far lives as long as we do: keep the collector away from it, so a
    collection in a forked worker does not write to (and copy) every page of the heap."""
    import gc

    gc.collect()
    gc.freeze()
    release_free_memory()


def start_lean_zygote(shell: object, close: list[int]) -> LeanZygote | None:
    """Fork the lean zygote off the core just loaded (see ``zygote.lean``); None when it cannot start."""
    import socket

    from .zygote import lean
    from .zygote.hugepages import own_maps

    if os.environ.get("MCPX_LEAN_ZYGOTE") != "1":  # the host's choice (``[pool] lean_interpreter``)
        return None
    freeze_heap()
    ours, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET)
    at_fork = own_maps()  # after the collection and the trim, just before the fork
    try:
        pid = lean.start(shell, theirs, [*close, ours.fileno()])
    except OSError:
        ours.close()
        theirs.close()
        return None
    return LeanZygote(ours, pid, at_fork)


def start_supervisor(ours: Any, theirs: Any, lean: LeanZygote | None, chan_in: int, chan_out: int) -> None:
    """Fork the supervisor, which keeps the host channel and ``ours`` (and the lean zygote's
    socket); this process keeps ``theirs``."""
    from .supervisor.supervisor import Supervisor
    from .zygote import zygote

    if os.fork() == 0:
        theirs.close()
        code = 1
        try:
            lean_zygote = zygote.Zygote(lean.socket, lean.pid) if lean else None
            code = Supervisor(zygote.Zygote(ours, os.getppid()), lean_zygote, chan_in, chan_out).serve()
        except BaseException:  # noqa: BLE001 - said on stderr (the host logs it), then the container ends
            import traceback

            traceback.print_exc()
        finally:
            os._exit(code)
    ours.close()
    if lean:
        lean.socket.close()
    os.close(chan_in)
    os.close(chan_out)
    from . import relay

    relay.forget_key_fd()  # the supervisor's alone: no worker (forked from here) may re-key the relay


if __name__ == "__main__":
    if os.getpid() == 1:
        sys.stderr.write("mcpx_agent must run under an init (docker run --init)\n")
    sys.exit(main())
