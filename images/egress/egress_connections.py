"""The egress addon's hooks on connections (see ``egress_addon``): the connection to the upstream
pinned to the address the policy checked, and checked again once made; a tunnel's first bytes (a
TLS ClientHello's SNI, an HTTP request's Host) naming its CONNECT target; every byte of a tunnel
counted against its grant, and the connection cut past a budget, once its grant ended, or at any
error of ours (fail closed)."""

import re
import time
from dataclasses import dataclass, field
from typing import Any

import egress_limits
from egress_policy import Claims, Grants, Policy, record
from hostpatterns import Pattern, as_ip, header_host, normalise_host
from mitmproxy import ctx, tcp
from mitmproxy.proxy import server_hooks
from mitmproxy.proxy.layers.tls import parse_client_hello

HEAD_LIMIT = 64 * 1024  # a tunnel's first bytes: a ClientHello or a request head must fit in this
OVER_BUDGET = "the sandbox holds too many unfinished first messages and request heads at once"


@dataclass(eq=False)  # hashed by identity: the budget of held bytes keeps it as a weak key
class Conn:
    """What the proxy decided for one client connection."""

    claims: Claims | None = None
    host: str | None = None  # a CONNECT's target
    port: int | None = None
    pattern: Pattern | None = None
    pins: dict[tuple[str, int], str] = field(default_factory=dict)  # (name, port) -> the checked address
    verdict: str | None = None  # why the connection is to be cut at its next bytes
    first_checked: bool = False
    held: bytearray = field(default_factory=bytearray)  # a tunnel's first bytes, until they name a host
    request: tuple[Claims, Pattern, str] | None = None  # a plain request's, for its upgrade (a TCP flow)


class Connections:
    """Mixed into the addon, which owns what these hooks read (its policy, grants and connections)."""

    policy: Policy
    grants: Grants
    conns: dict[str, Conn]
    cut_ids: set[str]

    def emit(self, event: dict[str, Any]) -> None:
        raise NotImplementedError

    def state(self, client_id: str) -> Conn:
        return self.conns.setdefault(client_id, Conn())

    def server_connect(self, data: server_hooks.ServerConnectionHookData) -> None:
        try:
            conn = self.conns.get(data.client.id)
            host, port = (data.server.address or ("", 0))[:2]
            name = normalise_host(str(host)) or str(host)
            pinned = None if conn is None else conn.pins.get((name, int(port)))
            if pinned is None and conn is not None and str(as_ip(name)) in conn.pins.values():
                pinned = name  # already the pinned address
            if pinned is None:
                data.server.error = f"egress: no policy decision for {name}:{port}"
                return
            if as_ip(name) is None:
                data.server.sni = name  # TLS to the name, TCP to the address that was checked
            data.server.address = (pinned, int(port))
        except Exception as exc:  # noqa: BLE001 - fail closed
            data.server.error = f"egress: the policy failed ({type(exc).__name__})"

    def server_connected(self, data: server_hooks.ServerConnectionHookData) -> None:
        conn = self.conns.get(data.client.id)
        peer = as_ip(str(data.server.peername[0])) if data.server.peername else None
        if conn is None or peer is None or str(peer) not in conn.pins.values():
            self.cut(data.client.id)

    def client_disconnected(self, client: Any) -> None:
        self.conns.pop(client.id, None)
        self.cut_ids.discard(client.id)

    def next_layer(self, nextlayer: Any) -> None:
        """A tunnelled connection's first bytes must name its CONNECT target (SNI or Host)."""
        conn = self.conns.get(nextlayer.context.client.id)
        if conn is None or conn.host is None or conn.first_checked:
            return
        if any(type(layer).__name__ in ("ClientTLSLayer", "ServerTLSLayer") for layer in nextlayer.context.layers):
            return  # inside an intercepted tunnel: requestheaders checks the SNI and Host
        data = bytes(nextlayer.data_client())
        try:
            if not egress_limits.hold_first(conn, nextlayer.context.client.peername, len(data)):
                raise ValueError(OVER_BUDGET)
            named = self._first_name(data, conn)
        except ValueError as exc:
            conn.first_checked, conn.verdict = True, str(exc)
            self.cut(nextlayer.context.client.id)  # now: undecided, mitmproxy would buffer on
            return
        if named is None:
            return  # still arriving: ``tcp_message`` holds the tunnel's bytes back until it names a host
        conn.first_checked = True
        egress_limits.hold_first(conn, nextlayer.context.client.peername, 0)
        if named != conn.host:
            conn.verdict = f"the connection names {named!r} inside a tunnel opened to {conn.host!r}"

    def _first_name(self, data: bytes, conn: Conn) -> str | None:
        if len(data) > HEAD_LIMIT:
            raise ValueError("the tunnel's first message is too large")
        if data[:1] == b"\x16":
            hello = parse_client_hello(data)
            if hello is None:
                return None
            return normalise_host(hello.sni) if hello.sni else conn.host
        if re.match(rb"[A-Za-z]{3,10} ", data):
            if b"\r\n\r\n" not in data:
                return None
            found = re.search(rb"\r\nHost:[ \t]*([^\r\n]*)\r\n", data.split(b"\r\n\r\n", 1)[0] + b"\r\n", re.I)
            return header_host(found.group(1).decode("latin-1")) if found else None
        return conn.host if data else None  # another protocol: nothing names a host in it

    def tcp_start(self, flow: tcp.TCPFlow) -> None:
        conn = self.conns.get(flow.client_conn.id)
        if conn is not None and conn.host is None and conn.request is not None:
            flow.metadata["egress"] = conn.request  # an upgraded plain request (a WebSocket)
        else:
            flow.metadata["egress"] = (conn.claims, conn.pattern, conn.host) if conn else (None, None, None)

    def tcp_message(self, flow: tcp.TCPFlow) -> None:
        message = flow.messages[-1]  # the object the layer sends on after this hook
        flow.messages.clear()  # counted, never kept: a tunnel's bytes are not the proxy's memory
        try:
            conn = self.conns.get(flow.client_conn.id)
            verdict: str | None = None
            if conn is not None and message.from_client and conn.host is not None and not conn.first_checked:
                self._hold_first(conn, message, flow.client_conn.peername)
            if conn is None or conn.claims is None:
                verdict = "no grant"
            elif conn.verdict is None:
                verdict = self.grants.count(self.policy, conn.claims, len(message.content), time.time())
                if conn.claims.grant in self.grants.ended:
                    verdict = "the run or session ended"
            else:
                verdict = conn.verdict
            counted = flow.metadata.setdefault("bytes", {"up": 0, "down": 0})
            counted["up" if message.from_client else "down"] += len(message.content)
        except Exception as exc:  # noqa: BLE001 - fail closed: nothing more goes through this tunnel
            verdict = f"the egress policy failed ({type(exc).__name__})"
        if verdict is not None:
            message.content = b""
            flow.metadata["cut"] = verdict
            self.cut(flow.client_conn.id)

    def _hold_first(self, conn: Conn, message: Any, peername: object) -> None:
        """Hold a tunnel's bytes back until its first message names a host, then check that name:
        mitmproxy settles a tunnel's layer on a request's Host line alone, before this addon sees a
        head sent in pieces whole, and asks ``next_layer`` no more."""
        conn.held += message.content
        try:
            if not egress_limits.hold_first(conn, peername, len(conn.held)):
                raise ValueError(OVER_BUDGET)
            named = self._first_name(bytes(conn.held), conn)
        except ValueError as exc:
            conn.first_checked, conn.verdict = True, str(exc)
            egress_limits.hold_first(conn, peername, 0)
            return
        if named is None:
            message.content = b""
            return
        conn.first_checked = True
        egress_limits.hold_first(conn, peername, 0)
        if named != conn.host:
            conn.verdict = f"the connection names {named!r} inside a tunnel opened to {conn.host!r}"
        message.content, conn.held = bytes(conn.held), bytearray()

    def tcp_end(self, flow: tcp.TCPFlow) -> None:
        self._record_tcp(flow)

    def tcp_error(self, flow: tcp.TCPFlow) -> None:
        self._record_tcp(flow)

    def _record_tcp(self, flow: tcp.TCPFlow) -> None:
        claims, pattern, host = flow.metadata.get("egress", (None, None, None))
        counted = flow.metadata.get("bytes", {"up": 0, "down": 0})
        decision = "cut" if "cut" in flow.metadata else "allowed"
        self.emit(
            record(
                decision,
                claims,
                host=host or "-",
                method="CONNECT",
                pattern=pattern,
                up=counted["up"],
                down=counted["down"],
                reason=flow.metadata.get("cut"),
            )
        )

    def cut(self, client_id: str) -> None:
        """Close a client's connection now (mitmproxy cannot kill a TCP flow in transit).

        Once per connection: cancelling the handler again while it closes would interrupt the close
        itself (the client then never sees its end)."""
        if client_id in self.cut_ids:
            return
        handler = ctx.master.addons.get("proxyserver").connections.get(client_id)
        io = None if handler is None else handler.transports.get(handler.client)
        if io is None:
            return
        self.cut_ids.add(client_id)
        if io.writer is not None:
            io.writer.close()  # the client sees its end even if the handler is mid-way
        if io.handler is not None:
            io.handler.cancel("egress: cut")
