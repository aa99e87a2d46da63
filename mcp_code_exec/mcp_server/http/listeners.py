"""The server's HTTP listeners (the MCP one and ``--metrics-port``): uvicorn in the server's own event
loop, with one budget of connections for all of them, and a quiet exit.

- At start the process's soft descriptor limit is raised to its hard limit, and the listeners'
  connections together may hold at most half of it (at least ``DESCRIPTOR_RESERVE`` fewer than the
  limit): the rest stays for what the server needs besides its clients (the engine's connections,
  each container's stream, volumes, pipes of the host's pip, code mode's upstreams). A connection
  past the budget is closed as soon as it is accepted, so a flood of idle connections from anyone
  who can reach a port never makes ``new_session`` fail with "Too many open files".
- A listener that is cancelled (SIGTERM or SIGINT end the server by cancelling its task group) stops
  accepting and shuts its application down (the ASGI lifespan) before it goes, bounded in time:
  left pending, the lifespan task would be cancelled as the event loop closes and uvicorn would log
  that as an ``ERROR`` with a traceback after "shut down cleanly".
"""

from __future__ import annotations

import ipaddress
import logging
import resource
import socket
from collections.abc import Iterator
from contextlib import contextmanager

import anyio
import uvicorn
from uvicorn.lifespan.on import LifespanOn

log = logging.getLogger(__name__)
DESCRIPTOR_RESERVE = 256  # descriptors never given to connections, whatever the limit
MIN_CONNECTIONS = 16  # the budget when the limit leaves less (the reserve still holds the rest)
SHUTDOWN_S = 5.0  # a cancelled listener's application gets this long to shut down


def is_loopback(host: str) -> bool:
    """Whether a listener bound to ``host`` is reachable from this machine only."""
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


class ConnectionBudget:
    """Open connections of all the server's listeners together (``total`` at most)."""

    def __init__(self, total: int) -> None:
        self.total = total
        self.open = 0

    def take(self) -> bool:
        if self.open >= self.total:
            return False
        self.open += 1
        return True

    def give_back(self) -> None:
        self.open = max(0, self.open - 1)

    def backlog(self, cap: int) -> int:
        """A listener's accept queue, which is also how many connections the event loop accepts at
        once, each a descriptor before the budget can close it: small, or a burst of connections
        would take the descriptors the budget keeps (uvicorn's default is 2048)."""
        return max(16, min(cap, self.total) // 8)


def raise_descriptor_limit() -> int:
    """The soft descriptor limit raised to the hard one (where allowed); returns the soft limit now."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if hard == resource.RLIM_INFINITY or hard > soft:
        target = hard if hard != resource.RLIM_INFINITY else max(soft, 65536)
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (target, hard))
        except (ValueError, OSError) as exc:
            log.debug("could not raise the descriptor limit: %s", exc)
    return resource.getrlimit(resource.RLIMIT_NOFILE)[0]


def connection_budget(*caps: int, limit: int | None = None) -> ConnectionBudget:
    """The budget for listeners with these caps of their own, within the descriptor ``limit`` (by
    default this process's, raised to its hard limit first)."""
    soft = raise_descriptor_limit() if limit is None else limit
    wanted = sum(caps)
    if soft == resource.RLIM_INFINITY:
        return ConnectionBudget(wanted)
    room = soft - max(DESCRIPTOR_RESERVE, soft // 2)
    return ConnectionBudget(min(wanted, max(room, MIN_CONNECTIONS)))


class QuietServer(uvicorn.Server):
    """uvicorn without its own signal handling: the server's cancels the task group and cleans up."""

    @contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield


async def serve_until_cancelled(server: QuietServer, sockets: list[socket.socket] | None = None) -> None:
    """``server.serve()``; cancelled, it stops listening and shuts the application down first."""
    try:
        await server.serve(sockets)
    finally:
        server.should_exit = True
        with anyio.CancelScope(shield=True), anyio.move_on_after(SHUTDOWN_S):
            await _wind_down(server)


async def _wind_down(server: QuietServer) -> None:
    for listening in getattr(server, "servers", ()):
        listening.close()
    lifespan = getattr(server, "lifespan", None)
    if server.started and isinstance(lifespan, LifespanOn) and not lifespan.shutdown_event.is_set():
        await lifespan.shutdown()  # what uvicorn's own shutdown does last; cancelled, it never ran
