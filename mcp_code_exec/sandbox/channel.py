"""Host side of the agent protocol over one container's byte stream.

``AgentChannel.run`` is the reader loop: start it with ``task_group.start(channel.run)``, which
returns once the agent said it is ready. Each request gets a ``Route``: the events the agent
sends for it, in order, through a bounded queue (a slow consumer slows the container down; it
never grows our memory).

Every byte read here comes from a container that runs hostile code. Whatever those bytes cause,
oversized or malformed frames, deep nesting, unknown events, or an error of our own while
handling them, ends the loop with ``close_reason`` set: the channel closes, waiting requests see
``SandboxLost``, and the container is replaced. Nothing raised here reaches the task group the
loop runs in, so no container can take the server down.
"""

from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass, field
from typing import Any

import anyio
from anyio.abc import ByteStream, TaskStatus
from anyio.streams.memory import MemoryObjectSendStream

from ..errors import ProtocolViolation, SandboxLost
from ..protocol.frames import (
    EVENT_PACES,
    RUN_PAYLOADS,
    SMALL_HEADER,
    Pace,
    event_decoder,
    event_header_limit,
    event_payload_limit,
)
from ..protocol.messages import Event, Ready, Request, event_id, parse_event

log = logging.getLogger(__name__)

ROUTE_BUFFER = 64  # events queued per request before the reader waits for the consumer
# Events for a request the host no longer waits on are dropped unread (an abandoned download's
# chunks still in flight, a few); so many are allowed at first, and so many more per request closed.
STRAYS_AT_FIRST = 64
STRAYS_PER_CLOSED_REQUEST = 16
STRAYS_AT_MOST = 1024
READ_CHUNK = 1 << 20

Routed = tuple[Event, bytes]


@dataclass
class Pending:
    """A request the host waits on: where its events go, what may still answer it, and the most
    each answer may carry (a run's images and done, a read's chunk)."""

    send: MemoryObjectSendStream[Routed]
    request: Request
    expecting: frozenset[str]
    payload_caps: dict[str, int]
    opened_at: float  # before the request was sent
    credit: dict[str, tuple[float, float]] = field(default_factory=dict)  # of a paced kind: (events, as of)

    def within_pace(self, kind: str, pace: Pace, now: float) -> bool:
        """Take one event of ``kind`` from its allowance; False once there is none left."""
        credit, since = self.credit.get(kind, (pace.at_first, self.opened_at))
        credit = min(credit + pace.per_s * (now - since), pace.at_first + pace.per_s * pace.most_s)
        if credit < 1:
            return False
        self.credit[kind] = (credit - 1, now)
        return True


class Route:
    """The events of one request, in order; close it when done with the request."""

    def __init__(self, channel: AgentChannel, request_id: int) -> None:
        self.channel = channel
        self.id = request_id
        self._send, self._receive = anyio.create_memory_object_stream[Routed](max_buffer_size=ROUTE_BUFFER)

    async def receive(self) -> Routed:
        try:
            return await self._receive.receive()
        except (anyio.EndOfStream, anyio.ClosedResourceError):
            raise SandboxLost(self.channel.close_reason) from None

    def close(self) -> None:
        channel = self.channel
        if channel._pending.pop(self.id, None) is not None:
            channel._strays_allowed = min(channel._strays_allowed + STRAYS_PER_CLOSED_REQUEST, STRAYS_AT_MOST)
        self._send.close()
        self._receive.close()


class AgentChannel:
    def __init__(self, stream: ByteStream, name: str) -> None:
        self.stream = stream
        self.name = name
        self.ready: Ready | None = None
        self.closed = anyio.Event()
        self.close_reason = "the sandbox container stopped"
        self._send_lock = anyio.Lock()
        self._next_id = 0
        self._pending: dict[int, Pending] = {}  # checked from each event's first bytes
        self._strays_allowed = STRAYS_AT_FIRST

    @property
    def alive(self) -> bool:
        return not self.closed.is_set()

    async def run(self, *, task_status: TaskStatus[None] = anyio.TASK_STATUS_IGNORED) -> None:
        try:
            await self._read_loop(task_status)
        except anyio.get_cancelled_exc_class():
            raise
        except ProtocolViolation as exc:
            self.close_reason = f"the sandbox sent malformed data ({exc}); it was replaced"
            log.warning("sandbox %s: %s", self.name, exc)
        except Exception as exc:
            self.close_reason = f"the sandbox's data could not be handled ({type(exc).__name__}); it was replaced"
            log.warning("sandbox %s: reading its channel failed", self.name, exc_info=True)
        finally:
            self.closed.set()
            for pending in list(self._pending.values()):
                pending.send.close()
            with anyio.CancelScope(shield=True):
                await self.stream.aclose()
        if self.ready is None:  # only then is anyone waiting on this (``task_group.start``)
            raise SandboxLost(f"the sandbox container exited before it was ready ({self.close_reason})")

    async def _read_loop(self, task_status: TaskStatus[None]) -> None:
        decoder = event_decoder(self._payload_limit, self._header_limit)
        while True:
            try:
                data = await self.stream.receive(READ_CHUNK)
            except (anyio.EndOfStream, anyio.BrokenResourceError, anyio.ClosedResourceError, OSError):
                return
            for header, payload in decoder.feed(data):
                if self.ready is None:
                    event = parse_event(header)
                    if not isinstance(event, Ready):
                        raise ProtocolViolation(f"the agent spoke before it was ready ({header.get('ev')!r})")
                    self.ready = event
                    task_status.started()
                    continue
                await self._route(header, payload)

    async def _route(self, header: dict[str, Any], payload: bytes) -> None:
        pending = self._pending.get(event_id(header) or -1)
        event = parse_event(header)  # parsed even when abandoned meanwhile: malformed is malformed
        if pending is not None:
            with contextlib.suppress(anyio.BrokenResourceError, anyio.ClosedResourceError):
                await pending.send.send((event, payload))  # suppressed: the request was abandoned meanwhile

    def _header_limit(self, kind: str, request_id: int | None) -> int | None:
        """How large an event's header may be, from its first bytes (None: skip it unread). Parsing
        one holds the event loop, so only an event its request may get now is parsed, within its
        kind's cap and pace; one for a request the host no longer waits on is skipped, a few of them."""
        if self.ready is None:
            return SMALL_HEADER  # the first event must be the ready, which is small
        if request_id is None or not 0 < request_id <= self._next_id:
            raise ProtocolViolation(f"a {kind!r} event for a request never sent")
        pending = self._pending.get(request_id)
        if pending is None:
            self._strays_allowed -= 1
            if self._strays_allowed < 0:
                raise ProtocolViolation("more events for finished requests than a sandbox sends")
            return None
        if kind not in pending.expecting:
            op, expected = pending.request.op, sorted(pending.expecting)
            raise ProtocolViolation(f"a {kind!r} event where its request ({op}) gets {expected}")
        pace = EVENT_PACES.get(kind)
        if pace is not None and not pending.within_pace(kind, pace, anyio.current_time()):
            raise ProtocolViolation(f"{kind!r} events faster than the agent sends them")
        pending.expecting = pending.request.after(kind)
        return event_header_limit(kind)

    def _payload_limit(self, header: dict[str, Any]) -> int:
        limit = event_payload_limit(header)
        kind = header.get("ev")
        pending = self._pending.get(event_id(header) or -1)
        caps = pending.payload_caps if pending is not None else {}
        if isinstance(kind, str) and (kind in caps or kind in RUN_PAYLOADS):  # a run's only with its caps
            limit = min(limit, caps.get(kind, 0))
        return limit

    async def start(self, request: Request, payload: bytes = b"") -> Route:
        """Send a request (its id is assigned here) and return the route of its events (those of
        ``request.answers``, each within ``request.payload_caps``)."""
        self._next_id += 1
        route = Route(self, self._next_id)
        sent = request.model_copy(update={"id": route.id})
        opened = anyio.current_time()
        self._pending[route.id] = Pending(route._send, sent, sent.answers(), sent.payload_caps(), opened)
        try:
            await self.send(sent.frame(payload))
        except BaseException:
            route.close()
            raise
        return route

    async def send(self, frame: bytes) -> None:
        if self.closed.is_set():
            raise SandboxLost(self.close_reason)
        async with self._send_lock:
            try:
                await self.stream.send(frame)
            except (anyio.BrokenResourceError, anyio.ClosedResourceError, OSError) as exc:
                raise SandboxLost(self.close_reason) from exc

    async def request(self, request: Request, payload: bytes = b"") -> Routed:
        """A request with exactly one reply (the agent's refusal is a ``Failure`` event)."""
        route = await self.start(request, payload)
        try:
            return await route.receive()
        finally:
            route.close()

    async def aclose(self) -> None:
        with anyio.CancelScope(shield=True):
            await self.stream.aclose()
