"""The egress relay: 127.0.0.1:3128 in the sandbox's own loopback, joined byte for byte to the
server's egress proxy (a unix socket on a volume mounted read-only), for sandboxes started with
egress (``MCPX_EGRESS_SOCKET``). The sandbox keeps no network: this is its only way out, and the
proxy decides everything. The relay parses nothing.

It is started before anything else in the container (``start``), as a process of its own: forked
twice, so init reaps it and no process of ours ever waits for it, and with a uid of its own
(``RELAY_UID``), no capabilities and no group, so the sandbox user can neither signal nor trace it,
and the supervisor's clean-up after a run leaves it alone (``processes.KEPT_PIDS``). One thread and
a selector: every connection costs two descriptors and two bounded buffers, never a thread (a
thread would count against the container's pids limit). When the proxy cannot be reached, the
client gets an HTTP 502 saying why, which clients show as their proxy error.

Each connection to the proxy begins with the container's key (``PREAMBLE``), which the proxy
checks against the grant the request presents: a grant works only from the container it was
issued to, whatever code copies it elsewhere (a fork's restored variables, another session). The
key comes from the host with each run (the run's ``egress_key``), through the supervisor, which
takes it out of the run's options before any worker sees them and writes it to this process on a
pipe of its own (``give_key``); it never enters the zygote or a worker, and this process's memory is
not the sandbox user's to read.
"""

from __future__ import annotations

import contextlib
import errno
import os
import selectors
import socket
import sys
import time

RELAY_UID = (1 << 30) - 2  # below the sandbox users' range (see the host's ownership.SANDBOX_UIDS)
PORT = 3128
MAX_CONNECTIONS = 64
BUFFER = 256 * 1024  # per direction and connection
REFUSE_DRAIN_S = 5.0
PREAMBLE = b"MCPX-EGRESS "  # + the container's key (64 hex digits) + a line end, before the client's bytes
KEY_LENGTH = 64
KEY_FD: int | None = None  # the write end of the key pipe: the supervisor's (``forget_key_fd`` in the zygote)
_given: str | None = None

UNREACHABLE = {
    errno.EPERM: "this sandbox may not connect to the proxy's socket (under gVisor, runsc must be registered "
    "with --host-uds=open; `mcp-code-exec doctor` checks it)",
    errno.EACCES: "this sandbox may not connect to the proxy's socket",
    errno.ENOENT: "the server's egress proxy is not running yet (it starts with the server); try again shortly",
    errno.ECONNREFUSED: "the server's egress proxy is not running (it is being started again); try again shortly",
}
NO_KEY = "this sandbox was given no egress credentials (its run has no egress)"


class Pair:
    """A client connection and its connection to the proxy, with what each still owes the other."""

    def __init__(self, client: socket.socket, proxy: socket.socket | None) -> None:
        self.client = client
        self.proxy = proxy
        self.to_proxy = bytearray()
        self.to_client = bytearray()
        self.client_eof = False
        self.proxy_eof = False
        self.refusing_until = 0.0  # a refusal was written: drain the client until it closes

    def sockets(self) -> list[socket.socket]:
        return [self.client] + ([self.proxy] if self.proxy is not None else [])


class Relay:
    def __init__(self, path: str, listener: socket.socket, key_fd: int) -> None:
        self.path = path
        self.listener = listener
        self.key_fd = key_fd
        self.key: bytes | None = None
        self.key_buffer = b""
        self.selector = selectors.DefaultSelector()
        self.pairs: dict[int, Pair] = {}  # fd of either side -> its pair
        self.selector.register(listener, selectors.EVENT_READ)
        self.selector.register(key_fd, selectors.EVENT_READ)

    def serve(self) -> None:
        while True:
            for key, _ in self.selector.select(timeout=1.0):
                if key.fileobj is self.listener:
                    self.accept()
                elif key.fileobj == self.key_fd:
                    self.read_key()
                else:
                    pair = self.pairs.get(key.fd)
                    if pair is not None:
                        self.pump(pair, key.fd)
            now = time.monotonic()
            for pair in {id(p): p for p in self.pairs.values()}.values():
                if pair.refusing_until and now > pair.refusing_until:
                    self.close(pair)

    def read_key(self) -> None:
        """Take the latest key the supervisor wrote (a line of hex digits each)."""
        try:
            data = os.read(self.key_fd, 4096)
        except BlockingIOError:
            return
        if not data:  # the supervisor is gone: the container is ending
            with contextlib.suppress(KeyError, ValueError):
                self.selector.unregister(self.key_fd)
            return
        lines = (self.key_buffer + data).split(b"\n")
        self.key_buffer = lines.pop()[:KEY_LENGTH]
        for line in lines:
            if len(line) == KEY_LENGTH:
                self.key = line

    def accept(self) -> None:
        try:
            client, _ = self.listener.accept()
        except OSError:
            return
        self.read_key()  # a key written before the cell began is in the pipe now: it is this run's
        if len({id(p) for p in self.pairs.values()}) >= MAX_CONNECTIONS:
            client.close()
            return
        client.setblocking(False)
        with contextlib.suppress(OSError):
            client.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        if self.key is None:
            self.refuse(client, NO_KEY)
            return
        proxy = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
        try:
            proxy.connect(self.path)  # a local socket: connected or refused at once
        except OSError as exc:
            proxy.close()
            self.refuse(client, UNREACHABLE.get(exc.errno or 0, f"the proxy cannot be reached ({exc.strerror})"))
            return
        proxy.setblocking(False)
        pair = Pair(client, proxy)
        pair.to_proxy += PREAMBLE + self.key + b"\n"
        for sock in pair.sockets():
            self.pairs[sock.fileno()] = pair
        self.watch(pair)

    def refuse(self, client: socket.socket, why: str) -> None:
        body = f"egress unavailable: {why}\n".encode()
        pair = Pair(client, None)
        pair.to_client += (
            b"HTTP/1.1 502 egress unavailable\r\nContent-Type: text/plain; charset=utf-8\r\n"
            + f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n".encode()
            + body
        )
        pair.proxy_eof = True
        pair.refusing_until = time.monotonic() + REFUSE_DRAIN_S
        self.pairs[client.fileno()] = pair
        self.watch(pair)

    def watch(self, pair: Pair) -> None:
        """Ask for what each side can do now: read while its buffer has room, write what it owes."""
        for sock, incoming, outgoing, eof in (
            (pair.client, pair.to_proxy, pair.to_client, pair.client_eof),
            (pair.proxy, pair.to_client, pair.to_proxy, pair.proxy_eof),
        ):
            if sock is None:
                continue
            events = 0
            if not eof and (len(incoming) < BUFFER or pair.proxy is None):
                events |= selectors.EVENT_READ
            if outgoing:
                events |= selectors.EVENT_WRITE
            try:
                if events and self._known(sock):
                    self.selector.modify(sock, events)
                elif events:
                    self.selector.register(sock, events)
                elif self._known(sock):
                    self.selector.unregister(sock)
            except (KeyError, ValueError, OSError):
                self.close(pair)
                return

    def _known(self, sock: socket.socket) -> bool:
        try:
            self.selector.get_key(sock)
            return True
        except KeyError:
            return False

    def pump(self, pair: Pair, fd: int) -> None:
        from_client = fd == pair.client.fileno()
        sock = pair.client if from_client else pair.proxy
        assert sock is not None
        try:
            if from_client and pair.proxy is None:
                self.drain(pair)
            else:
                self.move(pair, sock, from_client)
        except OSError:
            self.close(pair)
            return
        if pair.client_eof and pair.proxy_eof and not pair.to_client and not pair.to_proxy:
            self.close(pair)
        else:
            self.watch(pair)

    def move(self, pair: Pair, sock: socket.socket, from_client: bool) -> None:
        incoming = pair.to_proxy if from_client else pair.to_client
        outgoing = pair.to_client if from_client else pair.to_proxy
        other = pair.proxy if from_client else pair.client
        if outgoing:
            with contextlib.suppress(BlockingIOError):
                del outgoing[: sock.send(outgoing)]
            eof_other = pair.proxy_eof if from_client else pair.client_eof
            if not outgoing and eof_other:
                with contextlib.suppress(OSError):
                    sock.shutdown(socket.SHUT_WR)  # the other side ended: so does this one's input
        if len(incoming) < BUFFER and not (pair.client_eof if from_client else pair.proxy_eof):
            try:
                data = sock.recv(BUFFER - len(incoming))
            except BlockingIOError:
                return
            if data:
                incoming += data
            else:
                if from_client:
                    pair.client_eof = True
                else:
                    pair.proxy_eof = True
                if not incoming and other is not None:
                    with contextlib.suppress(OSError):
                        other.shutdown(socket.SHUT_WR)

    def drain(self, pair: Pair) -> None:
        """A refused client: write the refusal, then read and drop what it sends until it closes."""
        if pair.to_client:
            with contextlib.suppress(BlockingIOError):
                del pair.to_client[: pair.client.send(pair.to_client)]
            if not pair.to_client:
                with contextlib.suppress(OSError):
                    pair.client.shutdown(socket.SHUT_WR)
        try:
            if not pair.client.recv(65536):
                pair.client_eof = True
        except BlockingIOError:
            pass

    def close(self, pair: Pair) -> None:
        for sock in pair.sockets():
            self.pairs.pop(sock.fileno(), None)
            with contextlib.suppress(KeyError, ValueError, OSError):
                self.selector.unregister(sock)
            sock.close()


def give_key(key: object) -> None:
    """The supervisor's: hand the relay the container's key of a run (when it changed)."""
    global _given
    if KEY_FD is None or not isinstance(key, str) or key == _given:
        return
    if len(key) != KEY_LENGTH or any(ch not in "0123456789abcdef" for ch in key):
        return
    with contextlib.suppress(OSError):  # a full pipe or a relay gone: its connections fail closed
        os.write(KEY_FD, key.encode() + b"\n")
        _given = key


def forget_key_fd() -> None:
    """In the zygote, once the supervisor has its copy: the workers it forks never hold it."""
    global KEY_FD
    if KEY_FD is not None:
        with contextlib.suppress(OSError):
            os.close(KEY_FD)
        KEY_FD = None


def start(path: str) -> int | None:
    """Start the relay (double-forked, see the module's docstring); its pid, or None when it could
    not listen (the sandbox then simply has no egress)."""
    global KEY_FD
    ready_r, ready_w = os.pipe()
    key_r, key_w = os.pipe()
    first = os.fork()
    if first == 0:
        os.close(ready_r)
        os.close(key_w)
        code = 0
        try:
            pid = os.fork()
            if pid == 0:
                _become_relay(path, ready_w, key_r)
            os.write(ready_w, f"{pid}\n".encode())
        except BaseException:  # noqa: BLE001 - nothing may escape a forked child
            code = 1
        finally:
            os._exit(code)
    os.close(ready_w)
    os.close(key_r)
    os.set_blocking(key_w, False)
    KEY_FD = key_w
    os.waitpid(first, 0)
    with os.fdopen(ready_r, "rb") as ready:
        said = ready.read(64).split()
    # The relay itself writes "ok" once it listens (before or after its pid): until then no user
    # code may run, or it could take the port.
    pids = [int(word) for word in said if word.isdigit()]
    return pids[0] if pids and b"ok" in said else None


def _become_relay(path: str, ready_w: int, key_r: int) -> None:
    code = 0
    try:
        os.setsid()
        devnull = os.open("/dev/null", os.O_RDWR)
        os.dup2(devnull, 0)
        os.dup2(devnull, 1)
        low, high = sorted((ready_w, key_r))
        os.closerange(3, low)
        os.closerange(low + 1, high)
        os.closerange(high + 1, 1 << 16)
        os.set_blocking(key_r, False)
        listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        listener.bind(("127.0.0.1", PORT))
        listener.listen(MAX_CONNECTIONS)
        listener.setblocking(False)
        os.setgroups([])
        os.setresgid(RELAY_UID, RELAY_UID, RELAY_UID)
        os.setresuid(RELAY_UID, RELAY_UID, RELAY_UID)  # every capability goes with uid 0
        os.write(ready_w, b"ok\n")
        os.close(ready_w)
        Relay(path, listener, key_r).serve()
    except BaseException as exc:  # noqa: BLE001 - said on stderr (the host logs it); the relay ends
        sys.stderr.write(f"mcpx_agent: the egress relay stopped: {type(exc).__name__}: {exc}\n")
        code = 1
    finally:
        os._exit(code)
