"""The audit log: one sealed JSON line per call that runs code or changes state (see ``chain``).

What a line may hold is decided in ``redaction``, whoever records it. No token, no file content, no
argument value is ever passed in.

Lines are sealed and written in the order they are recorded, one ``write`` each (``fsync`` adds a
sync): in the server (``open(background=True)``) by a thread of the log's own (``audit_writer``), so
that neither a slow disk nor a sync holds the event loop; the time is the recording's. A failed
write loses its line and marks the log failing: ``status`` says so (for /healthz), the metrics count
it, and with ``required`` every call is refused until a write succeeds again (``require``), when a
gap line says how many were lost. One server writes one file (it holds a lock on it); past
``max_mb`` the file is renamed with the seq it begins at and a new one carries the chain on. The
last line written (``last``) is kept away from the file (``audit_head``) and given back as ``kept``
before ``open``: a file that ends before it had lines cut from its end (``audit.truncated``); an
empty (or removed) one goes on from the file rotated before it (a rotation a crash cut short) or
from that line, saying what is missing.

Anything logged on the ``mcp_code_exec.audit`` logger with ``extra={"fields": {...}}`` (code mode's
calls, sign-ins) is recorded too (``audit_logger``): its ``event`` field names the line.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import logging
import os
import threading
import time
from typing import Any

from ..config.accounting import AuditSettings
from ..errors import AuditUnavailable
from ..observability import metrics
from . import chain
from .audit_writer import WriterThread
from .chain import DAMAGED_EVENT, FILE_EVENT, REPLACED_EVENT, TRUNCATED_EVENT, ZERO, ends, iso, seal
from .redaction import redacted

log = logging.getLogger(__name__)
AUDIT_LOGGER = "mcp_code_exec.audit"
RESERVE = 64 << 10  # less free room than this where the log is, and it counts as full (``require``)
VERSION = 1
CLOSE_WAIT_S = 30.0  # how long closing waits for the lines still to be written


class AuditLog:
    def __init__(self, settings: AuditSettings, clock: Any = time.time) -> None:
        self.settings = settings
        self.path = settings.file
        self.key = settings.key.get_secret_value().encode() if settings.key is not None else None
        self.clock = clock
        self._fd: int | None = None
        self._size = 0
        self._file_id = (0, 0)  # the (device, inode) of the file opened at the path
        self._seq = -1
        self._head = ZERO
        self._file_no = -1
        self._lock = threading.Lock()
        self.failing: str | None = None  # why the last write failed, while it does
        self.failing_since: float | None = None
        self.lost = 0  # lines lost since the log last failed
        self._writer: WriterThread[tuple[dict[str, Any], float]] | None = None
        self.kept: tuple[int, str] | None = None  # the last line a server wrote, as kept away from the file
        self.last: tuple[int, str] | None = None  # the last line written here (one value: read from any thread)

    @property
    def enabled(self) -> bool:
        return self.path is not None

    # -- recording -------------------------------------------------------------------------------------
    def record(self, event: str, **fields: Any) -> bool:
        """Write one line (False when it could not be: the log is failing). No-op without a log."""
        if self.path is None:
            return True
        body, at = {"event": event, **redacted(fields, self.settings)}, self.clock()
        if self._writer is not None and self._writer.put((body, at)):  # written by the log's thread, in order
            return self.failing is None
        return self._record(body, at)

    def _record(self, body: dict[str, Any], at: float) -> bool:
        with self._lock:
            if self.failing is not None and not self._recover():
                self._lost()
                return False
            try:
                self._write(body, at)
            except OSError as exc:
                self._fail(exc)
                self._lost()
                return False
            except Exception as exc:  # a fault of ours: the line is lost all the same, and said to be
                self._fail(OSError(errno.EIO, f"the line could not be written: {exc!r}"))
                self._lost()
                raise
            metrics.audit_written(True)
            return True

    def require(self) -> None:
        """With ``required``: ``AuditUnavailable`` while the log cannot be written."""
        if not self.settings.required or self.path is None:
            return
        if self.failing is None and self._room():
            return  # the usual case: no wait for a line being written
        with self._lock:
            if self.failing is None and not self._room():  # full: the next line would be lost, so refuse now
                self._fail(OSError(errno.ENOSPC, f"No space left on device (under {RESERVE >> 10} KiB free)"))
            if self.failing is None or self._recover():
                return
        metrics.rejected("audit_unavailable")
        raise AuditUnavailable(
            f"the audit log cannot be written ({self.failing}): this server records every call and refuses "
            "those it cannot record; nothing was done. Tell the server's operator"
        )

    # -- the file ----------------------------------------------------------------------------------------
    def open(self, *, background: bool = False) -> None:
        """Take the log up where it ended (or begin it); a failure leaves it failing, said at once.
        ``background``: lines are written by a thread of the log's own from now on."""
        if self.path is None:
            return
        with self._lock:
            try:
                self._open()
                self._write({"event": "server", "outcome": "start"})
            except OSError as exc:
                self._fail(exc)
            else:
                metrics.audit_written(True)
        if background:
            self._writer = WriterThread(lambda line: self._record(*line), "mcpx-audit")

    def _open(self) -> None:
        assert self.path is not None
        self.path.parent.mkdir(parents=True, exist_ok=True, mode=0o700)
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            os.close(fd)
            raise OSError(errno.EBUSY, "another server writes this audit log (one server per file)") from None
        except BaseException:
            os.close(fd)
            raise
        status = os.fstat(fd)
        self._fd, self._size, self._file_id = fd, status.st_size, (status.st_dev, status.st_ino)
        if self._size == 0:
            if self._seq < 0:  # at a start: the chain may go on from a file rotated before, or the line kept
                self._go_on(chain.rotated_end(self.path, self.key))
            else:
                self._begin_file(self._head)
                self._check_kept()
            return
        last, first, damaged, cut = ends(self.path, self._size, self.key)
        if last is None:  # nothing to chain on to: beginning a new chain here would hide what it held
            self._close()
            raise OSError(
                errno.EILSEQ,
                f"{self.path} holds no sealed audit line to go on from (not an audit log, or destroyed); "
                "keep it for inquiry and move it aside to begin a new chain",
            )
        self._seq, self._head = int(last["seq"]), str(last["_hash"])
        self._file_no = int(first.get("file", 0)) if first is not None else 0
        if damaged:  # left where they are (``audit verify`` reports them); the chain goes on after them
            if cut:
                self._put_raw(b"\n")  # ends the line cut short, so that the next one stays whole
            log.error(
                "the audit log %s ends in %d line(s) that are not sealed audit lines, after seq %d: left where they "
                "are (audit verify reports them), the chain goes on from that line",
                self.path, damaged, self._seq,
            )  # fmt: skip
            self._put(
                *seal(
                    self._body({"event": DAMAGED_EVENT, "lines": damaged, "after_seq": self._seq}, self._head), self.key
                )
            )
        self._check_kept()

    def _go_on(self, before: tuple[int, str, int] | None) -> None:
        """An empty file at a start goes on from the file rotated before it, or the line kept: a cut is said."""
        kept = self.kept
        if before is not None:
            self._seq, self._head, self._file_no = before
        elif kept is not None:
            self._seq, self._head = kept
        self._begin_file(self._head)
        if kept is not None and (before is None or (before[0] <= kept[0] and before[:2] != kept)):
            self._say_cut(-1 if before is None else before[0], kept[0])

    def _check_kept(self) -> None:
        """The file ends before the last line kept as written, or holds another at its seq: said in the chain."""
        if self.kept is not None and self._seq <= self.kept[0] and (self._seq, self._head) != self.kept:
            self._say_cut(self._seq, self.kept[0])

    def _say_cut(self, ended: int, seq: int) -> None:
        log.error("the audit log %s ends at seq %d, a server wrote to seq %d: lines were cut", self.path, ended, seq)
        said = {"event": TRUNCATED_EVENT, "after_seq": ended, "kept_seq": seq}
        self._put(*seal(self._body(said, self._head), self.key))

    def _begin_file(self, prev: str) -> None:
        self._file_no += 1
        alg = "hmac-sha256" if self.key else "sha256"
        self._put(*seal(self._body({"event": FILE_EVENT, "file": self._file_no, "alg": alg}, prev), self.key))

    def _write(self, body: dict[str, Any], at: float | None = None) -> None:
        if self._fd is None:
            self._open()
        elif self._moved():
            self._take_back()
        line, sealed = seal(self._body(body, self._head, at), self.key)
        if self._size and self._size + len(line) > self.settings.max_bytes:
            self._rotate()
            line, sealed = seal(self._body(body, self._head, at), self.key)
        self._put(line, sealed)

    def _body(self, body: dict[str, Any], prev: str, at: float | None = None) -> dict[str, Any]:
        when = self.clock() if at is None else at
        return {"v": VERSION, "seq": self._seq + 1, "time": iso(when), **body, "prev": prev}

    def _put(self, line: bytes, sealed: str) -> None:
        self._put_raw(line)
        if self.settings.fsync and self._fd is not None:
            os.fsync(self._fd)
        self._seq, self._head = self._seq + 1, sealed
        self.last = (self._seq, sealed)

    def _put_raw(self, data: bytes) -> None:
        assert self._fd is not None
        view = memoryview(data)
        try:
            while view:
                view = view[os.write(self._fd, view) :]
        except OSError:
            if len(view) < len(data):  # written in part (a full disk): cut back, so the file ends in a whole line
                with contextlib.suppress(OSError):
                    os.ftruncate(self._fd, os.fstat(self._fd).st_size - (len(data) - len(view)))
            raise
        self._size += len(data)

    def _moved(self) -> bool:
        """Whether the path no longer names the file this server opened (removed, or another put there)."""
        assert self.path is not None
        try:
            there = os.stat(self.path)
        except FileNotFoundError:
            return True
        return (there.st_dev, there.st_ino) != self._file_id

    def _take_back(self) -> None:
        """The chain goes on from the head held here, in a new file at the path that says what happened
        (``audit verify`` reports that line); a file found in its place is set aside as it is."""
        assert self.path is not None
        log.error("the audit log %s was removed or replaced while this server wrote it: a new file goes on", self.path)
        self._close()
        with contextlib.suppress(FileNotFoundError):
            os.rename(self.path, f"{self.path}.replaced-{int(self.clock())}")
        after = self._seq  # the last line this server wrote to the file it lost
        self._new_file()
        self._put(*seal(self._body({"event": REPLACED_EVENT, "after_seq": after}, self._head), self.key))

    def _new_file(self) -> None:
        assert self.path is not None
        fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        status = os.fstat(fd)
        self._fd, self._size, self._file_id = fd, 0, (status.st_dev, status.st_ino)
        self._begin_file(self._head)

    def _rotate(self) -> None:
        assert self.path is not None and self._fd is not None
        os.fsync(self._fd)
        os.rename(self.path, f"{self.path}.{max(0, chain.first_seq(self.path)):012d}")  # named by its first seq
        self._close()
        self._new_file()
        chain.prune(self.path, self.settings.keep)

    def _close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None

    def close(self) -> None:
        if self.path is None:
            return
        self.record("server", outcome="stop")
        writer, self._writer = self._writer, None
        if writer is not None:  # what was recorded is written first
            writer.close(CLOSE_WAIT_S)
        with self._lock:
            if self._fd is not None:
                with contextlib.suppress(OSError):
                    os.fsync(self._fd)
            self._close()

    # -- failing and recovering ----------------------------------------------------------------------
    def _fail(self, exc: OSError) -> None:
        if self.failing is None:
            self.failing_since = self.clock()
            log.error("the audit log %s cannot be written: %s", self.path, exc.strerror or exc)
        self.failing = exc.strerror or str(exc)
        self._close()

    def _lost(self) -> None:
        self.lost += 1
        metrics.audit_written(False)

    def _room(self) -> bool:
        """Whether the filesystem holding the log has room for more lines (an unknown answer: yes)."""
        try:
            found = os.statvfs(self.path.parent) if self.path is not None else None
        except OSError:
            return True
        return found is None or found.f_bavail * found.f_frsize >= RESERVE

    def _recover(self) -> bool:
        """Try the file again; once a line goes in, a gap line says how many were lost."""
        if self.settings.required and not self._room():
            return False
        try:
            self._write({"event": "audit.gap", "lost": self.lost, "since": iso(self.failing_since or 0)})
        except OSError as exc:
            self._fail(exc)
            return False
        log.warning("the audit log %s is written again; %d line(s) were lost", self.path, self.lost)
        self.failing, self.failing_since, self.lost = None, None, 0
        metrics.audit_written(True)
        return True

    def status(self) -> dict[str, Any] | None:
        """For /healthz: None without a log."""
        if self.path is None:
            return None
        if self.failing is None:
            return {"ok": True, "seq": self._seq}
        return {"ok": False, "error": self.failing, "since": iso(self.failing_since or 0), "lost": self.lost}

    @property
    def healthy(self) -> bool:
        """False while a required log cannot be written (the server refuses calls then)."""
        return self.failing is None or not self.settings.required
