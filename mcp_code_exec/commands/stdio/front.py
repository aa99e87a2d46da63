"""``serve`` over stdio: a front that relays its client to the user's local service, starting it if needed.

A byte pipe after a one-line hello, standard library only (and the standard-library corners of
``config``), so that it answers its client's handshake at once. Where it falls in a client's first
second is drawn in docs/architecture.md ("A stdio client's first second"); here are the front's
parts: ``run_front`` answers the handshake early (``handshake``) while a thread reaches the service;
``reach`` connects, or takes the start lock and starts the service (``_start_service``: isolated, in
its private directory and a session of its own, its output in its log); ``StartReport`` is the ready
pipe it keeps, which says why a service it started could not start its sandboxes; ``relay`` copies
the bytes both ways, dropping the service's answer to a request the front answered already.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator, Mapping
from typing import Any

from ...config import greeting
from .handshake import (
    answer_line,
    answer_to,
    composed_answer,
    composing_refused,
    forget_answers,
    kept_answer,
    load_answers,
    read_first_line,
    refuse_composing,
)
from .isolation import leave_the_client, service_command
from .local_service import LocalServiceError, Place, connect, hello, identity_name, parsed_file, place_for

LOG_KEEP_BYTES = 4 * 1024 * 1024
CHUNK = 1 << 16
# The relay reads into one buffer per direction, as large as a pipe holds at most: a plot's image
# crosses in a few reads, with no new bytes object per read (nor a copy of it).
RELAY_BUFFER = 1 << 20
LOCK_POLL_S = 0.02


def run_front(explicit_config: str | None, log_level: str | None) -> int:
    environ = os.environ
    place_config = _config_argument(explicit_config)  # absolute, from the client's directory
    place = place_for(explicit_config, environ)
    parsed = parsed_file(place_config)
    started_in = leave_the_client(place.directory, parsed, place_config, environ)
    settings = parsed or {}
    name = identity_name(settings, environ)
    wait_s = _start_wait_s(settings)

    def greeted() -> tuple[socket.socket, StartReport | None]:
        return _reach_and_greet(place, place_config, log_level, wait_s, name, started_in)

    # Answer the client's handshake at once, while reaching the service (which may be starting):
    # with the answer its service kept, else with the one composed from the configuration.
    reached: list[tuple[socket.socket, StartReport | None] | BaseException] = []

    def reach_it() -> None:
        try:
            reached.append(greeted())
        except BaseException as exc:  # noqa: BLE001 - raised again in the main thread, below
            reached.append(exc)

    reaching = threading.Thread(target=reach_it, name="reach", daemon=True)
    reaching.start()
    first = read_first_line(0, CHUNK)
    early, unlike = early_answer(first, place, parsed, place_config, environ)
    if early is not None:
        try:
            _write_out(answer_line(*early))
        except OSError:
            return 0  # our client went away (stdout closed); a service being started goes on alone
    reaching.join()
    [outcome] = reached
    if isinstance(outcome, BaseException):
        raise outcome
    return relay(*outcome, first=first, early=early, on_unlike=unlike)


def early_answer(
    first: bytes, place: Place, parsed: dict[str, object] | None, config: str | None, environ: Mapping[str, str]
) -> tuple[tuple[dict[str, Any], dict[str, Any]] | None, Callable[[], None]]:
    """The client's first request and the answer the front gives it before the service does (None:
    the service answers it), with what to do if the service's own answer turns out unlike it."""
    kept = kept_answer(first, load_answers(place.answers))
    if kept is not None or parsed is None or composing_refused(place.composing_refused):
        return kept, functools.partial(forget_answers, place.answers)
    found = greeting.from_file(parsed, environ=environ, config_file=config)
    composed = composed_answer(first, greeting.instructions(found)) if found is not None else None
    return composed, functools.partial(refuse_composing, place.composing_refused)


def _reach_and_greet(
    place: Place, config: str | None, log_level: str | None, wait_s: float, name: str | None, started_in: str | None
) -> tuple[socket.socket, StartReport | None]:
    conn, started = reach(place, config, log_level, wait_s, started_in)
    try:
        hello(conn, name)
    except (LocalServiceError, OSError):
        conn.close()
        if started is not None:
            started.raise_failure()  # the service this front started could not start its sandboxes
        # The service was exiting (idle) as we connected: the next one is started afresh.
        conn, started = reach(place, config, log_level, wait_s, started_in)
        hello(conn, name)
    return conn, started


def _config_argument(explicit: str | None) -> str | None:
    path = explicit or os.environ.get("MCP_CODE_EXEC_CONFIG") or None
    return os.path.abspath(path) if path else None


def _start_wait_s(settings: dict[str, object]) -> float:
    stdio = settings.get("stdio")
    wait = stdio.get("start_timeout_s") if isinstance(stdio, dict) else None
    engine_wait = settings.get("engine_wait_s")
    wait_s = float(wait) if isinstance(wait, int | float) and wait > 0 else 60.0
    return wait_s + (float(engine_wait) if isinstance(engine_wait, int | float) and engine_wait > 0 else 0.0)


def reach(
    place: Place, config: str | None, log_level: str | None, wait_s: float, started_in: str | None = None
) -> tuple[socket.socket, StartReport | None]:
    """A connection to the running service, or to one this front starts (then with what it says)."""
    conn = connect(place)
    if conn is not None:
        return conn, None
    with _locked(place, time.monotonic() + wait_s) as lock:
        conn = connect(place)  # another front started it while this one waited for the lock
        if conn is not None:
            return conn, None
        with contextlib.suppress(FileNotFoundError):
            place.socket.unlink()  # no service answers it: one that was killed left it
        started = _start_service(place, config, log_level, wait_s, lock, started_in)
        conn = connect(place)
    if conn is None:
        started.raise_failure()
        raise LocalServiceError(f"the local service started but does not answer at {place.socket}; see {place.log}")
    return conn, started


@contextlib.contextmanager
def _locked(place: Place, deadline: float) -> Iterator[int]:
    """The start lock: held by the front that starts the service, then by that service until it
    listens (the front hands it over), so the next front waits and connects to it rather than
    taking its socket for a dead one and starting another."""
    handle = os.open(place.start_lock, os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        while True:
            try:
                fcntl.flock(handle, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if time.monotonic() >= deadline:
                    raise LocalServiceError(
                        f"another front has been starting the local service for too long (see {place.log})"
                    ) from None
                time.sleep(LOCK_POLL_S)  # flock has no timeout, and another process holds it: poll
        yield handle
    finally:
        os.close(handle)


def _start_service(
    place: Place, config: str | None, log_level: str | None, wait_s: float, lock: int, started_in: str | None
) -> StartReport:
    _trim_log(place)
    ready_read, ready_write = os.pipe()
    args = ["daemon", "--ready-fd", str(ready_write), "--start-lock-fd", str(lock)]
    args += ["--config", config] if config else []
    args += ["--log-level", log_level] if log_level else []
    log = os.open(place.log, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
    try:
        with open(os.devnull, "rb") as null:
            # Isolated, in the service's own private directory: never the client's (``isolation``).
            command, fds = service_command(args, started_in), (ready_write, lock)
            starter = subprocess.Popen(
                command, cwd=place.directory, stdin=null, stdout=log, stderr=log, pass_fds=fds, start_new_session=True
            )
    finally:
        os.close(log)
        os.close(ready_write)
    report = StartReport(ready_read, place, time.monotonic() + wait_s)
    try:
        said = report.next_line()
    except BaseException:
        report.close()
        raise
    finally:
        with contextlib.suppress(subprocess.TimeoutExpired):
            starter.wait(timeout=1.0)  # it forks the service and exits at once
    if said != "listening":
        report.close()
        raise _failure(said, place, wait_s)
    return report


class StartReport:
    """The ready pipe of the service this front started, kept after ``listening``: when the service
    closes the connection, its last line says whether its start failed, and why."""

    def __init__(self, fd: int, place: Place, deadline: float) -> None:
        self.fd: int | None = fd
        self.place = place
        self.deadline = deadline
        self.pending = bytearray()

    def next_line(self) -> str:
        """The next line the service says (bounded by the start's deadline); what it said before it
        closed the pipe or the time ran out, when there is no whole line."""
        while self.fd is not None and b"\n" not in self.pending:
            left = self.deadline - time.monotonic()
            readable, _, _ = select.select([self.fd], [], [], max(0.0, left))
            chunk = os.read(self.fd, 4096) if readable else b""
            if not chunk:
                break
            self.pending += chunk
        line, _, rest = bytes(self.pending).partition(b"\n")
        self.pending = bytearray(rest)
        return line.decode("utf-8", "replace").strip()

    def raise_failure(self) -> None:
        """Raise why the service could not start, if it says so (``ready``, or nothing: return)."""
        said = self.next_line()
        self.close()
        if said.startswith("error"):
            raise _failure(said, self.place, 0)

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _failure(said: str, place: Place, wait_s: float) -> LocalServiceError:
    failed = re.fullmatch(r"error (\d): (.*)", said, re.DOTALL)
    if failed is None:
        why = said or f"the local service was not ready within {wait_s:.0f} s"
        return LocalServiceError(f"{why} (see {place.log})")
    return LocalServiceError(f"{failed.group(2)} (the local service's log: {place.log})", int(failed.group(1)))


def _trim_log(place: Place) -> None:
    """Keep the log to its newest part: the service appends to it for as long as it lives."""
    with contextlib.suppress(OSError):
        if place.log.stat().st_size > LOG_KEEP_BYTES:
            place.log.replace(place.log.with_suffix(".log.1"))


def relay(
    conn: socket.socket,
    started: StartReport | None = None,
    *,
    first: bytes = b"",
    early: tuple[dict[str, Any], dict[str, Any]] | None = None,
    on_unlike: Callable[[], None] | None = None,
) -> int:
    """Copy stdin to the service and the service to stdout until either side closes. ``first``: what
    the client sent already; ``early``: its first request and the answer it was given (then the
    service's own answer to it is dropped; ``on_unlike`` is called if that differs). A service this
    front started that closes because its start failed: raise why."""
    stdin_closed = threading.Event()

    def upstream() -> None:
        buffer = bytearray(RELAY_BUFFER)
        view = memoryview(buffer)
        try:
            if first:
                conn.sendall(first)
            while count := os.readv(0, [buffer]):
                conn.sendall(view[:count])
        except OSError:
            pass
        finally:
            stdin_closed.set()
            with contextlib.suppress(OSError):
                conn.shutdown(socket.SHUT_WR)  # the service ends this client's session

    threading.Thread(target=upstream, name="stdin", daemon=True).start()
    answered = early is not None
    try:
        rest = b"" if early is None else _drop_service_answer(conn, *early, on_unlike)
        if rest is not None:
            _write_out(rest)
            buffer = bytearray(RELAY_BUFFER)
            view = memoryview(buffer)
            while count := conn.recv_into(buffer):
                answered = True
                _write_out(view[:count])
    except OSError:
        return 0  # our client went away (stdout closed)
    finally:
        conn.close()
    if started is not None and (not stdin_closed.is_set() or not answered):
        # The service closed on its own, or our client left before anything was answered: as before
        # the service listened first, the front's exit says whether the service could start.
        started.raise_failure()
    if started is not None:
        started.close()
    if stdin_closed.is_set():
        return 0
    print("mcp-code-exec: the local service closed the connection (see its log)", file=sys.stderr)
    return 1


def _drop_service_answer(
    conn: socket.socket, request: dict[str, Any], given: dict[str, Any], on_unlike: Callable[[], None] | None
) -> bytes | None:
    """Read the service's output up to its answer to ``request`` (the client was given one), and
    return what came after it; None if the service closed first. Lines before it go to the client.
    An answer unlike the one given (which a service of this build and configuration does not give)
    is said on stderr, and ``on_unlike`` keeps it from being given again."""
    pending = b""
    while chunk := conn.recv(CHUNK):
        pending += chunk
        while b"\n" in pending:
            line, pending = pending.split(b"\n", 1)
            answer = answer_to(line, request["id"])
            if answer is None:
                _write_out(line + b"\n")
                continue
            if answer.get("result") != given:
                if on_unlike is not None:
                    on_unlike()
                print("mcp-code-exec: the local service answered the handshake unlike the front", file=sys.stderr)
            return pending
    return None


def _write_out(data: bytes | memoryview) -> None:
    view = memoryview(data)
    while view:
        view = view[os.write(1, view) :]
