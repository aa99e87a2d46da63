"""The sandboxes' way in: the unix socket their relays connect to (on the volume they mount
read-only), joined byte for byte to mitmproxy's loopback port, inside mitmproxy's own process and
event loop. One process holds every connection: a process per connection (socat's way) let a few
sandboxes holding connections open use up the container's processes and deny egress to everyone.
Nothing here parses a request: it moves bytes, and reads the relay's one line before them.

Each connection begins with its relay's preamble, the key of the relay's container. The bridge
keeps the key's ``binding`` under the local port of its connection to mitmproxy, where the addon
finds it (``binding_of`` the client's address) and checks it against the grant the request
presents: a grant works only from the container it was issued to. Caps: ``PER_CONTAINER``
connections per container (its relay's own cap), ``total`` for all of them (the server sizes it,
and the container's descriptors, for every sandbox it may run at once); a preamble that does not
arrive within ``PREAMBLE_S`` ends its connection.
"""

import asyncio
import contextlib
import hashlib
import os
import socket

PREAMBLE = b"MCPX-EGRESS "
KEY_LENGTH = 64
PREAMBLE_S = 10.0
PER_CONTAINER = 64
CHUNK = 64 * 1024
HEX = frozenset(b"0123456789abcdef")


def binding(key: bytes) -> str:
    """What a grant claims of its container's key (``mcp_code_exec.egress.tokens.binding``)."""
    return hashlib.sha256(b"mcp-code-exec egress container\0" + key).hexdigest()[:32]


def read_preamble(line: bytes) -> str | None:
    """The binding a relay's preamble line names, or None for a line that is not one."""
    if not line.startswith(PREAMBLE) or not line.endswith(b"\n"):
        return None
    key = line[len(PREAMBLE) : -1]
    if len(key) != KEY_LENGTH or not set(key) <= HEX:
        return None
    return binding(key)


class Bridge:
    def __init__(self, path: str, gid: int, port: int, total: int) -> None:
        self.path = path
        self.gid = gid
        self.port = port
        self.total = total
        self.ports: dict[int, str] = {}  # local port of a connection to mitmproxy -> its container's binding
        self.per_container: dict[str, int] = {}
        self.open = 0
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> None:
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.path)
        old = os.umask(0o077)  # the owner's alone until its group and mode are set
        try:
            self.server = await asyncio.start_unix_server(self.handle, path=self.path, limit=CHUNK, backlog=1024)
        finally:
            os.umask(old)
        # Only the relays may connect (their group, which this container is in too): sandbox code that
        # mounts the socket cannot open connections of its own around its relay's cap.
        os.chown(self.path, -1, self.gid)
        os.chmod(self.path, 0o660)

    def binding_of(self, address: object) -> str | None:
        """The container a client connection of mitmproxy's comes from (its peer address is ours)."""
        if isinstance(address, tuple) and len(address) >= 2 and address[0] == "127.0.0.1":
            return self.ports.get(int(address[1]))
        return None

    async def handle(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        held: str | None = None
        upstream: asyncio.StreamWriter | None = None
        port = 0
        if self.open >= self.total:
            writer.close()
            return
        self.open += 1
        try:
            try:
                async with asyncio.timeout(PREAMBLE_S):
                    line = await reader.readuntil(b"\n")
            except (TimeoutError, asyncio.IncompleteReadError, asyncio.LimitOverrunError):
                return
            found = read_preamble(line)
            if found is None or self.per_container.get(found, 0) >= PER_CONTAINER:
                return
            held = found
            self.per_container[held] = self.per_container.get(held, 0) + 1
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            try:
                sock.setblocking(False)
                sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                sock.bind(("127.0.0.1", 0))
                port = sock.getsockname()[1]
                self.ports[port] = held  # before any byte reaches mitmproxy, whose hooks look it up
                await asyncio.get_running_loop().sock_connect(sock, ("127.0.0.1", self.port))
            except OSError:
                sock.close()
                return
            up_reader, upstream = await asyncio.open_connection(sock=sock, limit=CHUNK)
            await asyncio.gather(self.pipe(reader, upstream), self.pipe(up_reader, writer))
        except OSError:
            pass
        finally:
            if held is not None:
                self.per_container[held] -= 1
                if not self.per_container[held]:
                    del self.per_container[held]
            if port:
                self.ports.pop(port, None)
            self.open -= 1
            for end in (writer, upstream):
                if end is not None:
                    end.close()

    @staticmethod
    async def pipe(reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        """One direction, until its end (passed on as a half close) or an error (closing both)."""
        try:
            while data := await reader.read(CHUNK):
                writer.write(data)
                await writer.drain()
            if writer.can_write_eof():
                writer.write_eof()
        except OSError:
            writer.close()
            reader.feed_eof()
