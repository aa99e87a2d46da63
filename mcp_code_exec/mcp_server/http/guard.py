"""What keeps the HTTP listener answering under a flood of connections that never finish: uvicorn's
HTTP/1.1 protocol with these limits (the ``[http]`` settings).

========================  =====================================================  ==============
what                      must                                                   else
========================  =====================================================  ==============
an idle connection        see its next request begin within ``keep_alive_s``     closed
a request's headers       arrive within ``header_timeout_s`` of their first byte  closed
a WebSocket upgrade       not happen (``guarded_config``)                        plain HTTP
a request's body          arrive within ``body_timeout_s``, plus a second per    408, closed
                          ``body_min_rate_kib_s`` KiB that arrived
an answer                 be read within ``response_timeout_s``, plus a second   aborted
                          per ``response_min_rate_kib_s`` KiB read
one client's connections  number at most ``max_connections_per_client``          429, closed
all connections           stay within ``max_connections`` and the budget of all  closed at once
                          listeners (``listeners.ConnectionBudget``)
========================  =====================================================  ==============

Why each: uvicorn has no header deadline, and about a thousand connections that never finish their
headers exhaust the process's descriptors. The idle deadline is uvicorn's keep-alive, set longer than
clients keep an idle connection: a server that closes first races the client's next request, which then
fails with no answer (httpx's ``ReadError``) though the server never saw it. Time while the server is
not taking the body (uvicorn paused reading: the app is busy, or the client waits for ``100 Continue``)
does not count, so a large upload has time and a trickle does not hold the connection. An unread answer
is aborted, not closed: a close would keep what waits until it is read. A connection counts for the
client of its latest request that names one (its bearer token), until it closes; a file URL's request
counts for the URL's issuer only while it runs (whoever holds a URL could otherwise lock its issuer out
with refused requests). Warnings are rate-limited (``logs``), so a flood cannot fill the log.
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import Any, ClassVar

import h11
import uvicorn
from starlette.types import ASGIApp, Receive, Scope, Send
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.h11_impl import H11Protocol

from ...config.faces import HttpSettings
from .listeners import ConnectionBudget

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Claimant:
    """The client a request counts for; ``this_request_only``: only while it runs (a file URL's
    issuer: the request may come from anyone who holds the URL)."""

    name: str
    this_request_only: bool = False


Identify = Callable[[Scope], Awaitable[Claimant | None]]  # the client a request counts for, if it names one
TIMED_OUT = (
    b"HTTP/1.1 408 Request Timeout\r\nContent-Type: text/plain; charset=utf-8\r\nConnection: close\r\n"
    b"Content-Length: %d\r\n\r\n%s"
)


class ClientShares:
    """Open connections per client; each counts for the client of its latest request."""

    def __init__(self, per_client: int) -> None:
        self.per_client = per_client
        self.held: dict[str, int] = {}

    def take(self, client: str) -> bool:
        if self.held.get(client, 0) >= self.per_client:
            return False
        self.held[client] = self.held.get(client, 0) + 1
        return True

    def give_back(self, client: str | None) -> None:
        if client is None:
            return
        left = self.held.get(client, 0) - 1
        if left > 0:
            self.held[client] = left
        else:
            self.held.pop(client, None)


class TimedFlow(FlowControl):
    """uvicorn's flow control, adding up how long reading was paused (the server not taking bytes)."""

    def __init__(self, transport: asyncio.Transport, clock: Callable[[], float]) -> None:
        super().__init__(transport)
        self.clock = clock
        self.paused_since: float | None = None
        self.paused_s = 0.0

    def pause_reading(self) -> None:
        if not self.read_paused:
            self.paused_since = self.clock()
        super().pause_reading()

    def resume_reading(self) -> None:
        if self.read_paused and self.paused_since is not None:
            self.paused_s += self.clock() - self.paused_since
            self.paused_since = None
        super().resume_reading()

    def paused_total(self) -> float:
        return self.paused_s + (self.clock() - self.paused_since if self.paused_since is not None else 0.0)


@dataclass(frozen=True)
class Guard:
    settings: HttpSettings
    shares: ClientShares
    identify: Identify | None  # None: no shares (every request names no client)
    budget: ConnectionBudget | None = None  # shared with the server's other listeners


class GuardedH11Protocol(H11Protocol):
    """uvicorn's HTTP/1.1 protocol with the deadlines and shares above (``guarded_protocol`` sets them)."""

    guard: ClassVar[Guard]
    _header_timer: asyncio.TimerHandle | None = None
    _body_timer: asyncio.TimerHandle | None = None
    _unread_timer: asyncio.TimerHandle | None = None
    _client: str | None = None
    _client_for_this_request = False
    _budgeted = False  # this connection holds one of the budget's
    _idle = False  # between requests: the next one's first byte arms the header deadline

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._body_started = self._body_paused = 0.0
        self._body_bytes = 0
        self._unread_since = 0.0
        self._unread_from = 0
        if self.guard.identify is not None:
            self.app = self._counted(self.app)

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self.flow = TimedFlow(transport, self.loop.time)
        budget = self.guard.budget
        if len(self.connections) > self.guard.settings.max_connections or (budget is not None and not budget.take()):
            transport.close()
            return
        self._budgeted = budget is not None
        self._arm()

    def data_received(self, data: bytes) -> None:
        if self._idle:
            self._idle = False
            self._arm()
        if self._body_timer is not None:
            self._body_bytes += len(data)
        super().data_received(data)

    def handle_events(self) -> None:
        cycle = self.cycle
        super().handle_events()
        if self.cycle is not cycle:  # a request's headers arrived
            self._disarm()
            if self.conn.their_state is h11.SEND_BODY:
                self._start_body()
        if self._body_timer is not None and self.conn.their_state is not h11.SEND_BODY:
            self._stop_body()  # the body is in (or the connection is done)

    def on_response_complete(self) -> None:
        if self._client_for_this_request:  # a file URL's request is over: its issuer's share is given back
            self.guard.shares.give_back(self._client)
            self._client, self._client_for_this_request = None, False
        super().on_response_complete()  # arms uvicorn's keep-alive: keep_alive_s for the next request to begin
        self._idle = not self.transport.is_closing() and self.cycle is not None and self.cycle.response_complete
        if self._idle and self.conn.trailing_data[0]:  # the next request began already, in the same packet
            self._idle = False
            self._arm()

    def pause_writing(self) -> None:
        super().pause_writing()
        if self._unread_timer is None:
            self._unread_since = self.loop.time()
            self._unread_from = self.transport.get_write_buffer_size()
            self._unread_timer = self.loop.call_later(self.guard.settings.response_timeout_s, self._check_unread)

    def resume_writing(self) -> None:
        super().resume_writing()
        self._stop_unread()

    def connection_lost(self, exc: Exception | None) -> None:
        self._disarm()
        self._stop_body()
        self._stop_unread()
        self.guard.shares.give_back(self._client)
        self._client = None
        if self._budgeted and self.guard.budget is not None:
            self.guard.budget.give_back()
            self._budgeted = False
        super().connection_lost(exc)

    # -- the header deadline -------------------------------------------------------------------
    def _arm(self) -> None:
        self._disarm()
        self._header_timer = self.loop.call_later(self.guard.settings.header_timeout_s, self._expire)

    def _disarm(self) -> None:
        if self._header_timer is not None:
            self._header_timer.cancel()
            self._header_timer = None

    def _expire(self) -> None:
        self._header_timer = None
        if not self.transport.is_closing():
            self.transport.close()

    # -- the body deadline ---------------------------------------------------------------------
    def _start_body(self) -> None:
        self._stop_body()
        self._body_started, self._body_bytes = self.loop.time(), 0
        self._body_paused = self._paused()
        self._body_timer = self.loop.call_later(self.guard.settings.body_timeout_s, self._check_body)

    def _stop_body(self) -> None:
        if self._body_timer is not None:
            self._body_timer.cancel()
            self._body_timer = None

    def _paused(self) -> float:
        return self.flow.paused_total() if isinstance(self.flow, TimedFlow) else 0.0

    def _check_body(self) -> None:
        self._body_timer = None
        if self.conn.their_state is not h11.SEND_BODY or self.transport.is_closing():
            return
        if self.cycle is not None and self.cycle.waiting_for_100_continue:
            self._start_body()  # the client waits for the app to ask for the body: its clock starts then
            return
        settings = self.guard.settings
        sending = self.loop.time() - self._body_started - (self._paused() - self._body_paused)
        allowed = settings.body_timeout_s + self._body_bytes / (settings.body_min_rate_kib_s * 1024)
        if sending < allowed:
            self._body_timer = self.loop.call_later(max(allowed - sending, 0.05), self._check_body)
        else:
            log.warning("a request body came too slowly (%d bytes in %.0f s): 408", self._body_bytes, sending)
            self._cut_body()

    def _cut_body(self) -> None:
        """408 (when nothing was answered yet), and the connection closed; the app hears a disconnect."""
        settings, cycle = self.guard.settings, self.cycle
        if cycle is not None and not cycle.response_started:
            text = (
                f"the request body did not arrive in time ({settings.body_timeout_s:g} s, then at least "
                f"{settings.body_min_rate_kib_s:g} KiB/s); the connection is closed\n"
            ).encode()
            self.transport.write(TIMED_OUT % (len(text), text))
        if cycle is not None:  # whatever the app answers now goes nowhere
            cycle.disconnected = True
            cycle.message_event.set()
        self.transport.close()

    # -- the response deadline -----------------------------------------------------------------
    def _stop_unread(self) -> None:
        if self._unread_timer is not None:
            self._unread_timer.cancel()
            self._unread_timer = None

    def _check_unread(self) -> None:
        self._unread_timer = None
        settings, waiting = self.guard.settings, self.transport.get_write_buffer_size()
        if not waiting:
            return
        read = max(0, self._unread_from - waiting)
        sending = self.loop.time() - self._unread_since
        allowed = settings.response_timeout_s + read / (settings.response_min_rate_kib_s * 1024)
        if sending < allowed:
            self._unread_timer = self.loop.call_later(max(allowed - sending, 0.05), self._check_unread)
            return
        log.warning("a response was read too slowly (%d bytes in %.0f s, %d waiting): aborted", read, sending, waiting)
        if self.cycle is not None:  # whatever the app sends now goes nowhere
            self.cycle.disconnected = True
            self.cycle.message_event.set()
        self.flow.resume_writing()  # an app waiting to send more goes on, and finds the client gone
        self.transport.abort()

    # -- the per-client share --------------------------------------------------------------------
    def _counted(self, inner: Any) -> Any:
        async def app(scope: Scope, receive: Receive, send: Send) -> None:
            if scope["type"] == "http" and not await self._admit(scope):
                await too_many(send, self.guard.settings.max_connections_per_client)
                return
            await inner(scope, receive, send)

        return app

    async def _admit(self, scope: Scope) -> bool:
        identify = self.guard.identify
        claimant = await identify(scope) if identify is not None else None
        if claimant is None:
            return True
        if claimant.name != self._client:
            if not self.guard.shares.take(claimant.name):
                return False
            self.guard.shares.give_back(self._client)
            self._client = claimant.name
        self._client_for_this_request = claimant.this_request_only
        return True


def guarded_protocol(
    settings: HttpSettings, identify: Identify | None = None, budget: ConnectionBudget | None = None
) -> type[asyncio.Protocol]:
    """The protocol class for uvicorn's ``http=``: one share table for all its connections."""
    guard = Guard(settings, ClientShares(settings.max_connections_per_client), identify, budget)
    return type("GuardedH11Protocol", (GuardedH11Protocol,), {"guard": guard})


def guarded_config(
    app: ASGIApp,
    settings: HttpSettings,
    identify: Identify | None = None,
    budget: ConnectionBudget | None = None,
    **options: Any,
) -> uvicorn.Config:
    """uvicorn's configuration for a listener under this guard. No WebSocket: the server serves
    none, and an upgraded connection leaves this protocol without its ``connection_lost``, so its
    place in the budget and its client's share would never be given back."""
    protocol = guarded_protocol(settings, identify, budget)
    return uvicorn.Config(app, http=protocol, ws="none", timeout_keep_alive=settings.keep_alive_s, **options)


async def too_many(send: Send, per_client: int) -> None:
    body = (
        f"too many connections open for this client: at most {per_client} at once "
        "(http.max_connections_per_client; a file URL counts for the client that asked for it); "
        "close some, or retry once one has ended\n"
    ).encode()
    headers = [
        (b"content-type", b"text/plain; charset=utf-8"),
        (b"content-length", str(len(body)).encode()),
        (b"retry-after", b"1"),
        (b"connection", b"close"),
    ]
    await send({"type": "http.response.start", "status": 429, "headers": headers})
    await send({"type": "http.response.body", "body": body, "more_body": False})
