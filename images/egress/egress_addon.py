"""mitmproxy addon: controlled egress for mcp-code-exec sandboxes.

Loaded by mitmdump in the proxy container (see ``egress_entry``). The server's messages arrive on
stdin (JSON lines, the control channel); access records and replies leave on fd 3, the container's
stdout (mitmproxy's own log goes to stderr). The decisions are ``egress_policy``'s; here they are
applied, hook by hook:

- ``http_connect`` and ``requestheaders`` (plain HTTP): the grant, the budget, the host (normalised)
  against the grant's reach, the name resolved here (the container's /etc/hosts, then DNS) to an
  address that is global or in ``private_ranges``, which the connection is then pinned to
  (``server_connect`` rewrites the address: no second lookup, no rebinding; ``server_connected``
  checks the peer it reached).
- inside an intercepted tunnel (a host with a secret): the Host header and the SNI must name the
  CONNECT target; the secret header is set (a sandbox's own header of that name is replaced).
- a tunnelled (not intercepted) connection: its first bytes (a TLS ClientHello's SNI, or an HTTP
  request's Host) must name the CONNECT target, or it is cut before any byte reaches the upstream.
- every byte is counted against the grant's run and its identity's day; past a budget, or once the
  grant ended, the connection is cut.

Sandboxes come in through ``egress_bridge`` (in this process), which tells which container each
connection comes from: a grant is taken only from the container it was issued to. A connection
whose first request head has not arrived within ``HEAD_S``, or with any request head begun and not
whole within it, is closed.

Every decision hook fails closed: an exception refuses the request, fails the connect or cuts the
tunnel (mitmproxy itself would log it and let the flow go on).
"""

import asyncio
import json
import os
import re
import socket
import sys
import threading
import time
from collections.abc import Callable
from typing import Any

import egress_limits
from egress_bridge import Bridge
from egress_connections import Conn, Connections
from egress_limits import bound_heads
from egress_lookups import Lookups
from egress_policy import Claims, Grants, Policy, Refused, record
from hostpatterns import Pattern, header_host, normalise_host
from mitmproxy import ctx, http

EVENTS_FD = 3
GRANT_KEY = "/run/egress/grant.key"  # written by egress_entry (this container's tmpfs), read once
REALM = 'Basic realm="mcp-code-exec egress"'
SOCKET = "/sock/proxy.sock"
HEAD_S = 60.0  # a connection's first request head must have arrived by then, and each head be whole


class Egress(Connections):
    def __init__(self) -> None:
        self.policy = Policy()
        self.grants = Grants(key=read_key(GRANT_KEY))
        self.conns: dict[str, Conn] = {}
        self.cut_ids: set[str] = set()
        self.loop: asyncio.AbstractEventLoop | None = None
        self.events = os.fdopen(os.dup(EVENTS_FD), "w", buffering=1)
        self.bridge = Bridge(
            SOCKET,
            int(os.environ["EGRESS_SOCKET_GID"]),
            int(os.environ["EGRESS_PORT"]),
            int(os.environ["EGRESS_MAX_CONNECTIONS"]),
        )
        egress_limits.count_heads_by(self.bridge.binding_of)  # the unfinished heads add up per container
        egress_limits.watch_heads(self._head_begun)
        self.head_s = float(os.environ.get("EGRESS_HEAD_S", HEAD_S))
        self.lookups = Lookups()  # a wildcard entry's names, a few at a time per container

    # -- the control channel ------------------------------------------------------------------------
    async def running(self) -> None:
        self.loop = asyncio.get_running_loop()
        await self.bridge.start()
        threading.Thread(target=self._read_control, name="egress-control", daemon=True).start()
        self.emit({"ev": "ready", "pid": os.getpid()})

    def client_connected(self, client: Any) -> None:
        if self.loop is not None:
            self.loop.call_later(self.head_s, self._head_due, client.id)

    def _head_due(self, client_id: str) -> None:
        if client_id not in self.conns:  # no request head yet: a connection held open, sending nothing
            self.cut(client_id)

    def _head_begun(self, client_id: str, unfinished: Callable[[], bool]) -> None:
        """Every request head, not a connection's first alone, must be whole within ``head_s``."""
        if self.loop is not None:
            self.loop.call_later(self.head_s, self._head_late, client_id, unfinished)

    def _head_late(self, client_id: str, unfinished: Callable[[], bool]) -> None:
        if unfinished():
            self.cut(client_id)

    def _read_control(self) -> None:
        assert self.loop is not None
        for line in sys.stdin:
            try:
                message = json.loads(line)
            except ValueError:
                continue
            if isinstance(message, dict):
                self.loop.call_soon_threadsafe(self.control, message)
        # stdin closed: the server went away, and so does the proxy (a sandbox's lifeline too)
        self.loop.call_soon_threadsafe(ctx.master.shutdown)

    def control(self, message: dict[str, Any]) -> None:
        op, ident = message.get("op"), message.get("id")
        try:
            now = time.time()
            if op == "config":
                self.policy = Policy.from_message(message)
                ctx.options.update(allow_hosts=self.policy.intercepted())
            elif op == "narrow":
                grant = str(message["grant"])
                self.grants.narrow(grant, frozenset(int(i) for i in message["reach"]))
                self._cut_where(lambda conn: conn.claims is not None and conn.claims.grant == grant, self._out_of_reach)
            elif op == "run":
                self.grants.new_run(str(message["grant"]))
            elif op == "end":
                grant = str(message["grant"])
                self.grants.end(grant, float(message.get("expires", now + 86400)))
                self._cut_where(lambda conn: conn.claims is not None and conn.claims.grant == grant, None)
            elif op == "usage":
                self.grants.restore_day(str(message["day"]), {str(k): int(v) for k, v in message["used"].items()})
            elif op == "ping":
                self.grants.prune(now)
                pong = {"ev": "pong", "id": ident, "conns": len(self.conns), "bridged": self.bridge.open}
                self.emit({**pong, "heads": egress_limits.held_most()})
                return
            else:
                raise ValueError(f"unknown op {op!r}")
            if ident is not None:
                self.emit({"ev": "ack", "id": ident})
        except Exception as exc:  # noqa: BLE001 - a bad message is reported, never fatal
            self.emit({"ev": "nack", "id": ident, "op": str(op)[:40], "error": f"{type(exc).__name__}: {exc}"[:300]})

    def emit(self, event: dict[str, Any]) -> None:
        self.events.write(json.dumps(event, separators=(",", ":")) + "\n")

    def _out_of_reach(self, conn: Conn) -> bool:
        """A connection whose entry a narrowing took away (the others of its grant go on)."""
        if conn.claims is None or conn.pattern is None:
            return False
        return self.policy.patterns.index(conn.pattern) not in self.grants.reach(conn.claims)

    def _cut_where(self, mine: Any, only: Any) -> None:
        for client_id, conn in list(self.conns.items()):
            if mine(conn) and (only is None or only(conn)):
                conn.verdict = "the session's egress was narrowed, or its run ended"
                self.cut(client_id)

    # -- decisions ------------------------------------------------------------------------------------
    async def decide(
        self, flow: http.HTTPFlow, conn: Conn, header: str | None, raw_host: str, port: int
    ) -> tuple[Claims, Pattern, str]:
        """The grant, its entry for this host and the address to connect to; ``Refused`` otherwise."""
        now = time.time()
        binding = self.bridge.binding_of(flow.client_conn.peername)
        claims = self.grants.claims(header, now, binding)
        conn.claims = claims
        problem = self.grants.budget_error(self.policy, claims, now)
        if problem is not None:
            raise Refused(403, problem)
        host = normalise_host(raw_host)
        if host is None:
            raise Refused(403, f"{raw_host[:100]!r} is not a host name or an IP address")
        pattern = self.grants.match(self.policy, claims, host, port)
        addresses: list[str] = []
        if pattern.literal is None:
            try:
                addresses = await self.lookups.addresses(binding, host, port)
            except socket.gaierror as exc:
                raise Refused(403, f"the proxy cannot resolve {host!r} ({exc.strerror})") from None
        address = self.policy.choose(host, addresses, pattern)
        conn.pins[(host, port)] = address
        return claims, pattern, host

    def refuse(self, flow: http.HTTPFlow, refusal: Refused, host: str, claims: Claims | None) -> None:
        headers = {"Content-Type": "text/plain; charset=utf-8", "X-Egress-Refused": (host or "-")[:255]}
        if refusal.status == 407:
            headers["Proxy-Authenticate"] = REALM
        flow.response = http.Response.make(refusal.status, f"egress refused: {refusal.reason}\n", headers)
        # The reason phrase carries it too: a refused CONNECT reaches the code as the client
        # library's proxy error, which shows the status line and never the body.
        flow.response.reason = re.sub(r"[^ -~]", "?", f"egress refused: {refusal.reason}")[:300]
        self.emit(
            record(
                "refused", claims, host=host, method=flow.request.method, status=refusal.status, reason=refusal.reason
            )
        )

    async def http_connect(self, flow: http.HTTPFlow) -> None:
        conn = self.state(flow.client_conn.id)
        host = flow.request.host
        try:
            _, pattern, host = await self.decide(
                flow, conn, flow.request.headers.get("Proxy-Authorization"), flow.request.host, flow.request.port
            )
            conn.host, conn.port, conn.pattern = host, flow.request.port, pattern
        except Refused as refusal:
            self.refuse(flow, refusal, host, conn.claims)
        except Exception as exc:  # noqa: BLE001 - fail closed
            self.refuse(flow, Refused(403, f"the egress policy failed ({type(exc).__name__})"), host, conn.claims)

    async def requestheaders(self, flow: http.HTTPFlow) -> None:
        if flow.request.method == "CONNECT":
            return
        conn = self.state(flow.client_conn.id)
        host = flow.request.host
        try:
            await self._request(flow, conn)
        except Refused as refusal:
            self.refuse(flow, refusal, host, conn.claims)
        except Exception as exc:  # noqa: BLE001 - fail closed
            self.refuse(flow, Refused(403, f"the egress policy failed ({type(exc).__name__})"), host, conn.claims)

    async def _request(self, flow: http.HTTPFlow, conn: Conn) -> None:
        named = header_host(flow.request.host_header)
        if conn.host is not None:  # inside an intercepted CONNECT tunnel (a host with a secret)
            claims, pattern, host = conn.claims, conn.pattern, conn.host
            sni = normalise_host(flow.client_conn.sni or host)
            if named != host or sni != host:
                raise Refused(
                    403,
                    f"the request names {named!r} (TLS name {sni!r}) inside a tunnel opened to {host!r}; "
                    "each host is reached through a connection of its own",
                )
            if claims is None or claims.grant in self.grants.ended:
                raise Refused(407, "these egress credentials are of a run or session that has ended")
        else:  # plain HTTP through the proxy (an absolute URL)
            claims, pattern, host = await self.decide(
                flow, conn, flow.request.headers.get("Proxy-Authorization"), flow.request.host, flow.request.port
            )
            if flow.request.host_header is not None and named != host:
                raise Refused(403, f"the Host header {flow.request.host_header[:100]!r} does not name {host!r}")
        assert claims is not None and pattern is not None
        problem = self.grants.budget_error(self.policy, claims, time.time())
        if problem is not None:
            raise Refused(403, problem)
        flow.request.headers.pop("Proxy-Authorization", None)
        secrets = self.policy.secrets_for(host, flow.request.port, tls=flow.request.scheme == "https")
        for header, value in secrets:
            flow.request.headers[header] = value  # replaces what the sandbox sent, never merges
        flow.metadata["egress"] = conn.request = (claims, pattern, host)
        flow.request.stream = self._counter(flow, claims, "up")

    def responseheaders(self, flow: http.HTTPFlow) -> None:
        if "egress" in flow.metadata and flow.response is not None:
            flow.response.stream = self._counter(flow, flow.metadata["egress"][0], "down")

    def _counter(self, flow: http.HTTPFlow, claims: Claims, key: str) -> Any:
        counted = flow.metadata.setdefault("bytes", {"up": 0, "down": 0})

        def chunk(data: bytes) -> bytes:
            counted[key] += len(data)
            problem = self.grants.count(self.policy, claims, len(data), time.time())
            if problem is not None or claims.grant in self.grants.ended:
                flow.metadata["cut"] = problem or "the run or session ended"
                self.cut(flow.client_conn.id)
                return b""
            return data

        return chunk

    def response(self, flow: http.HTTPFlow) -> None:
        self._record_http(flow, "cut" if "cut" in flow.metadata else "allowed")

    def error(self, flow: http.HTTPFlow) -> None:
        self._record_http(flow, "cut" if "cut" in flow.metadata else "error")

    def _record_http(self, flow: http.HTTPFlow, decision: str) -> None:
        if "egress" not in flow.metadata:
            return
        claims, pattern, host = flow.metadata["egress"]
        counted = flow.metadata.get("bytes", {"up": 0, "down": 0})
        head_up = len(bytes(flow.request.headers))
        head_down = len(bytes(flow.response.headers)) if flow.response else 0
        self.grants.count(self.policy, claims, head_up + head_down, time.time())
        status = flow.response.status_code if flow.response else None
        self.emit(
            record(
                decision,
                claims,
                host=host,
                method=flow.request.method,
                pattern=pattern,
                status=status,
                up=counted["up"] + head_up,
                down=counted["down"] + head_down,
                reason=flow.metadata.get("cut"),
                intercepted=True,
            )
        )


def read_key(path: str) -> bytes:
    with open(path, "rb") as handle:
        key = bytes.fromhex(handle.read().decode("ascii"))
    os.unlink(path)
    if len(key) < 32:
        raise SystemExit("egress: no grant key")
    return key


bound_heads()
addons = [Egress()]
