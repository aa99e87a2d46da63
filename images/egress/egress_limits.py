"""A bound mitmproxy lacks: the size of an HTTP/1 message head (its own code says "FIXME: protect
against header size DoS"). Without it a request whose head never ends (a header line of gigabytes,
no blank line) is buffered whole, and one sandbox fills the shared proxy's memory until it is
killed, cutting every other sandbox's egress. A head past ``HEAD_MAX`` is answered 431 (a request)
and its connection closed. The unfinished request heads of one container's connections (its
``binding``, read from the bridge) add up to at most ``EGRESS_HEADS_BUDGET`` bytes (the server sizes it
from the proxy's memory and the sandboxes it may run): past it, the head that went over is answered
431 too, so that a sandbox holding its 64 connections each with a head just under ``HEAD_MAX`` cannot
take the memory every sandbox shares. A tunnel's first message, held back until it names a host
(``egress_connections``), counts against the same budget (``hold_first``). 64 KiB is far above any
real request head (browsers and HTTP servers cap theirs at 8-16 KiB per line, nginx 32 KiB in all).

Applied when the addon is loaded, to the classes of the locked mitmproxy version; should they have
changed, the addon fails to load and the proxy stops (mitmdump exits on an error at its start).
"""

from __future__ import annotations

import itertools
import os
import weakref
from collections.abc import Callable, Generator
from typing import Any

HEAD_MAX = 64 * 1024
HEADS_BUDGET_DEFAULT = 1024 * 1024
# The binding of a client connection's peer address: the bridge's ``binding_of``, given by the addon.
_binding_of: list[Callable[[object], str | None]] = []
# binding -> the layers reading a request head, each with the bytes of its head so far (weak: a
# layer dropped without its connection's close event is no longer counted)
_held: dict[str, weakref.WeakKeyDictionary[Any, int]] = {}
_keys: weakref.WeakKeyDictionary[Any, str] = weakref.WeakKeyDictionary()
# layer -> the serial number of the request head it is reading, from its first byte to its end; the
# addon is told of each head begun, and cuts its connection if that head is unfinished at its deadline
_begun: weakref.WeakKeyDictionary[Any, int] = weakref.WeakKeyDictionary()
_serials = itertools.count()
_watch: list[Callable[[str, Callable[[], bool]], None]] = []


def watch_heads(begun: Callable[[str, Callable[[], bool]], None]) -> None:
    """``begun(client_id, unfinished)`` is called as each request head begins."""
    _watch[:] = [begun]


def _head_begins(layer: Any, size: int) -> None:
    if not size:
        _begun.pop(layer, None)
        return
    if layer in _begun:
        return
    serial = _begun[layer] = next(_serials)
    ref = weakref.ref(layer)

    def unfinished() -> bool:
        found = ref()
        return found is not None and _begun.get(found) == serial

    if _watch:
        _watch[0](str(layer.conn.id), unfinished)


def count_heads_by(binding_of: Callable[[object], str | None]) -> None:
    _binding_of[:] = [binding_of]


def _key(layer: Any) -> str:
    """The binding a layer's heads count against, found once (the bridge forgets it at the close)."""
    key = _keys.get(layer)
    if key is None:
        found = _binding_of[0](layer.conn.peername) if _binding_of else None
        key = _keys[layer] = found or "-"
    return key


def hold_first(conn: Any, peername: object, size: int) -> bool:
    """Counts ``size`` bytes of a tunnel's first message held back (by mitmproxy or the addon) for
    ``conn`` against its container's budget, with its request heads; False past the budget."""
    found = _binding_of[0](peername) if _binding_of else None
    return hold(conn, found or "-", size) <= heads_budget()


def held_most() -> int:
    """The most bytes of unfinished request heads one container holds now (for the server's ping)."""
    return max((sum(heads.values()) for heads in _held.values()), default=0)


def heads_budget() -> int:
    return int(os.environ.get("EGRESS_HEADS_BUDGET", HEADS_BUDGET_DEFAULT))


def hold(layer: Any, key: str, size: int) -> int:
    """Records ``size`` as ``layer``'s unfinished head, and returns all that ``key`` holds."""
    heads = _held.get(key)
    if heads is None:
        if not size:
            return 0
        heads = _held[key] = weakref.WeakKeyDictionary()
    if size:
        heads[layer] = size
    else:
        heads.pop(layer, None)
    total = sum(heads.values())
    if not heads:
        del _held[key]
    return total


def bound_heads() -> None:
    try:
        from mitmproxy.proxy import commands, events
        from mitmproxy.proxy.layers.http import _http1

        classes = (_http1.Http1Server, _http1.Http1Client)
        for cls in classes:
            if getattr(cls.read_headers, "egress_bounded", False):
                continue
            cls.read_headers = _bounded(cls.read_headers, commands, events, _http1)
    except (ImportError, AttributeError) as exc:
        raise SystemExit(f"egress: mitmproxy's HTTP/1 layer is not the one this addon bounds ({exc})") from None


def _bounded(original: Callable[..., Any], commands: Any, events: Any, http1: Any) -> Callable[..., Any]:
    def read_headers(self: Any, event: Any) -> Generator[Any, None, None]:
        yield from original(self, event)
        waiting = getattr(self.state, "__func__", None) is read_headers
        size = len(self.buf) if waiting and isinstance(event, events.DataReceived) else 0
        server = isinstance(self, http1.Http1Server)
        held = 0
        if server:
            _head_begins(self, size)
            held = hold(self, _key(self), size)
        if size > HEAD_MAX or held > heads_budget():
            if server:
                hold(self, _key(self), 0)
                _head_begins(self, 0)
                yield commands.SendData(self.conn, http1.make_error_response(431, "the request head is too large"))
                yield commands.CloseConnection(self.conn)
            else:  # an upstream's response: the client gets mitmproxy's 502 for it
                yield commands.CloseConnection(self.conn)
                yield http1.ReceiveHttp(
                    http1.ResponseProtocolError(
                        self.stream_id, "the response head is too large", http1.ErrorCode.GENERIC_SERVER_ERROR
                    )
                )
            self.state = self.done

    read_headers.egress_bounded = True  # type: ignore[attr-defined]
    return read_headers
