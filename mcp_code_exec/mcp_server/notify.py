"""Change notifications for both protocol eras, scoped to the identity the change belongs to.

2026-07-28 clients listen with ``subscriptions/listen`` (the SDK's handler, fed by our bus);
2025-era clients subscribe with ``resources/subscribe`` and get list-changed on their connection.
Every event carries its owner: a listen stream, a subscription or a connection only ever hears
of its own identity's sessions and runs, and a subscription to another identity's URI is refused
like one to a URI that does not exist.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Awaitable, Callable
from typing import Any

import anyio
import anyio.lowlevel
from mcp import MCPError
from mcp.server.subscriptions import ResourcesListChanged, ResourceUpdated, ServerEvent
from mcp.types import INVALID_PARAMS

from ..service.run_registry import Run
from .identity import current_identity
from .sdk import connection_of, kept_on

log = logging.getLogger(__name__)
Owns = Callable[[str, str], bool]  # (identity, uri) -> whether that identity may see the uri


class ScopedBus:
    """A ``SubscriptionBus`` whose listeners hear only their own identity's events.

    The SDK's listen handler subscribes from inside the listen request, so the identity of the
    listening client is read from the request's auth context at that moment.
    """

    def __init__(self) -> None:
        self._listeners: dict[object, tuple[str, Callable[[ServerEvent], None]]] = {}

    def subscribe(self, listener: Callable[[ServerEvent], None]) -> Callable[[], None]:
        token = object()
        self._listeners[token] = (current_identity(), listener)

        def unsubscribe() -> None:
            self._listeners.pop(token, None)

        return unsubscribe

    async def publish(self, event: ServerEvent) -> None:
        """Events published without an owner (the SDK's own) are not about anyone's data: all hear them."""
        await self.publish_to(None, event)

    async def publish_to(self, identity: str | None, event: ServerEvent) -> None:
        for owner, listener in list(self._listeners.values()):
            if identity is not None and owner != identity:
                continue
            try:
                listener(event)
            except Exception:
                log.exception("a subscription listener raised")
        await anyio.lowlevel.checkpoint()


class Notifier:
    def __init__(self, owns: Owns) -> None:
        self.bus = ScopedBus()
        self._owns = owns
        # 2025-era connections, by identity. What we know of one lives on the connection object
        # itself (``_state``, kept on it by ``sdk.kept_on``), so it goes away with the connection;
        # the sets only hold weak refs.
        self._legacy: dict[str, weakref.WeakSet[Any]] = {}

    def seen(self, ctx: Any) -> None:
        """Remember a 2025-era connection (so list-changed reaches every connection of its identity)."""
        session = getattr(ctx, "session", None)
        if session is None or getattr(ctx, "protocol_version", None) == "2026-07-28":
            return
        connection = connection_of(session)
        _state(connection, session)
        self._legacy.setdefault(current_identity(), weakref.WeakSet()).add(connection)

    async def subscribe(self, ctx: Any, uri: str) -> None:
        if not self._owns(current_identity(), uri):
            raise MCPError(code=INVALID_PARAMS, message=f"no such resource: {uri[:200]}")
        self.seen(ctx)
        _state(connection_of(ctx.session), ctx.session)["uris"].add(uri)

    async def unsubscribe(self, ctx: Any, uri: str) -> None:
        _state(connection_of(ctx.session), ctx.session)["uris"].discard(uri)

    async def run_finished(self, run: Run) -> None:
        """A run ended (whoever waits for it, if anyone): its owner's clients hear of the files it changed."""
        if run.result is not None and run.result.files:
            await self.changed(run.owner, [info.uri for info in run.result.files if info.uri is not None])

    async def changed(self, identity: str, uris: list[str]) -> None:
        """Tell ``identity``'s clients, of both eras, that its resources changed (these URIs in particular)."""
        with anyio.move_on_after(2):
            await self.bus.publish_to(identity, ResourcesListChanged())
            for uri in uris:
                await self.bus.publish_to(identity, ResourceUpdated(uri=uri))
            for connection in list(self._legacy.get(identity, ())):
                state = _state(connection, None)
                session = state["session"]
                if session is None:
                    continue
                await _quietly(session.send_resource_list_changed())
                for uri in uris:
                    if uri in state["uris"]:
                        await _quietly(session.send_resource_updated(uri))


def _state(connection: Any, session: Any) -> dict[str, Any]:
    state: dict[str, Any] = kept_on(connection, lambda: {"session": session, "uris": set()})
    if state["session"] is None:
        state["session"] = session
    return state


async def _quietly(sending: Awaitable[Any]) -> None:
    try:
        await sending
    except Exception as exc:  # noqa: BLE001 - a gone client must not fail the change that happened
        log.debug("notification not delivered: %s", exc)
