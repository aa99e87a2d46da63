"""A bound mitmproxy lacks: the size of an HTTP/1 message head (its own code says "FIXME: protect
against header size DoS"). Without it a request whose head never ends (a header line of gigabytes,
no blank line) is buffered whole, and one sandbox fills the shared proxy's memory until it is
killed, cutting every other sandbox's egress. A head past ``HEAD_MAX`` is answered 431 (a request)
and its connection closed.

Applied when the addon is loaded, to the classes of the locked mitmproxy version; should they have
changed, the addon fails to load and the proxy stops (mitmdump exits on an error at its start).
"""

from __future__ import annotations

from collections.abc import Callable, Generator
from typing import Any

HEAD_MAX = 256 * 1024


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
        if waiting and isinstance(event, events.DataReceived) and len(self.buf) > HEAD_MAX:
            if isinstance(self, http1.Http1Server):
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
