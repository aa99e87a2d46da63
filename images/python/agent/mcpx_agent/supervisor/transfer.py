"""Files of any size in and out of /mnt/data, one bounded chunk per request.

Reads: every ``read_chunk`` opens the file afresh (nothing is held between requests) and reads
at most ``MAX_CHUNK`` bytes at an offset; it reports the file's size and mtime, and the host
refuses a file that changes between chunks.

Writes: an upload appends chunk after chunk, in order, to a staging file under
``/mnt/data/.mcpx-uploads`` (the same filesystem as its target, so the last step is one atomic
rename). Before every chunk the session's quota is checked, counting what is staged; the last
chunk fsyncs the staging file, renames it over the target and fsyncs the directory. A chunk that
fails, or an abort, removes the staging file; a supervisor starting on a volume removes any a dead
container left. Everything happens with the sandbox user's filesystem identity, through the same
``O_NOFOLLOW`` walk as the other file tools.
"""

from __future__ import annotations

import contextlib
import errno
import os
import re
import time
from typing import Any, NamedTuple

from .. import history_format
from ..identity import as_sandbox_user
from . import quota
from .files import FileError, check_target, file_error, open_dir, open_regular, split_path
from .tree import RESERVED

MAX_CHUNK = 4 << 20  # the largest chunk either way (the host moves 1 MiB); the host's module states it too
STAGING = ".mcpx-uploads"
MAX_UPLOADS = 4  # open at once; the host holds a session for the length of a transfer, so one is usual
REMEASURE_S = 1.0  # how often an upload walks /mnt/data again (between walks it counts what it staged)
PURGE_LIMIT = 1000
UPLOAD_ID = re.compile(r"[0-9a-f]{32}")
EXPORT_TEMP = "export.ipynb.tmp"  # in /mnt/data/.mcpx, where the worker writes an exported notebook


class QuotaError(FileError):
    """The session's quota would be exceeded; the host tells this refusal from others."""


class TooLargeError(FileError):
    """The file would be over the sandbox's file-size limit (``RLIMIT_FSIZE``)."""


def read_chunk(path: str, offset: int, length: int) -> tuple[dict[str, Any], bytes]:
    if offset < 0 or not 0 <= length <= MAX_CHUNK:
        raise FileError(f"a chunk is read at an offset >= 0, at most {MAX_CHUNK} bytes at a time")
    parts = split_path(path)
    with as_sandbox_user():
        fd, st = open_regular(parts, path)
        try:
            if parts[:2] == [RESERVED, "history"] and not history_format.servable(st):
                raise FileError(f"{path}: hard-linked or sparse; a history file is served only as a file of its own")
            want = max(0, min(length, st.st_size - offset))
            data = os.pread(fd, want, offset) if want else b""
        except OSError as exc:
            raise file_error(exc, path) from exc
        finally:
            os.close(fd)
    if len(data) != want:
        raise FileError(f"{path}: changed while being read")
    meta = {"path": "/".join(parts), "offset": offset, "size": st.st_size, "modified": st.st_mtime}
    return {**meta, "mtime_ns": st.st_mtime_ns}, data


class Placed(NamedTuple):
    """A file put in place under /mnt/data: its path there, and its stat once there."""

    path: str
    stat: os.stat_result


class Upload:
    """One upload being staged."""

    __slots__ = ("fd", "id", "measured", "measured_at", "measured_size", "options", "parts", "size", "staging_fd")

    def __init__(self, id: str, parts: list[str], options: dict[str, Any], staging_fd: int, fd: int) -> None:
        self.id, self.parts, self.options = id, parts, options
        self.staging_fd = staging_fd  # the staging directory
        self.fd = fd  # the staging file
        self.size = 0
        self.measured: tuple[int, int] | None = None  # (bytes, entries) of the last walk
        self.measured_size = 0  # bytes staged at that walk
        self.measured_at = 0.0


class Uploads:
    """The uploads in progress, by the id the host gave each."""

    def __init__(self) -> None:
        self.open: dict[str, Upload] = {}

    def chunk(self, request: dict[str, Any], payload: bytes) -> int | Placed:
        """Stage one chunk (``offset`` must be where the last one ended); on ``final``, put the file in
        place. Returns the bytes staged so far, or where the file was put (with its new stat)."""
        upload_id, offset, final = str(request["upload"]), int(request["offset"]), bool(request["final"])
        if not UPLOAD_ID.fullmatch(upload_id):
            raise FileError("bad upload id")
        if len(payload) > MAX_CHUNK:
            raise FileError(f"a chunk is at most {MAX_CHUNK} bytes")
        upload = self.open.get(upload_id)
        if upload is None:
            if offset != 0:
                raise FileError("no such upload (it failed or was aborted); nothing was written")
            upload = self.begin(upload_id, str(request["path"]), request)
        try:
            if split_path(str(request["path"])) != upload.parts or offset != upload.size:
                raise FileError("a chunk out of order, or for another path; the upload was aborted")
            self.check_quota(upload, len(payload))
            view = memoryview(payload)
            while view:
                view = view[os.write(upload.fd, view) :]
            upload.size += len(payload)
            if final:
                return self.commit(upload)
        except OSError as exc:
            self.abort(upload_id)
            refusal = file_error(exc, "/".join(upload.parts))
            if exc.errno == errno.EFBIG:
                raise TooLargeError(f"{refusal}; nothing was written") from exc
            raise refusal from exc
        except BaseException:
            self.abort(upload_id)
            raise
        return upload.size

    def begin(self, upload_id: str, path: str, request: dict[str, Any]) -> Upload:
        parts = split_path(path)
        if len(self.open) >= MAX_UPLOADS:
            raise FileError(f"{MAX_UPLOADS} uploads are already in progress; nothing was written")
        options = {key: request.get(key) for key in ("data_quota_bytes", "data_quota_files")}
        total = request.get("total")
        over = quota.quota_error(options, extra_bytes=int(total)) if isinstance(total, int) else None
        if over:
            raise QuotaError(f"nothing was written: {over}")
        with as_sandbox_user():
            target = open_dir(parts[:-1], create=True)  # refused now, not after the last chunk
            try:
                check_target(target, parts[-1], path)
            finally:
                os.close(target)
            root = open_dir([])
            try:
                with contextlib.suppress(FileExistsError):
                    os.mkdir(STAGING, 0o700, dir_fd=root)
            except OSError as exc:
                raise file_error(exc, STAGING) from exc
            finally:
                os.close(root)
            staging = open_dir([STAGING])
            try:
                flags = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC
                fd = os.open(upload_id, flags, 0o644, dir_fd=staging)
            except OSError as exc:
                os.close(staging)
                if not self.open:
                    _remove_staging_dir()
                raise file_error(exc, path) from exc
        upload = Upload(id=upload_id, parts=parts, options=options, staging_fd=staging, fd=fd)
        self.open[upload_id] = upload
        return upload

    def check_quota(self, upload: Upload, extra: int) -> None:
        """Refuse a chunk that would take /mnt/data over the quota. /mnt/data is walked at most every
        ``REMEASURE_S`` (the staging file included); in between, what was staged since is added."""
        options = upload.options
        if not options.get("data_quota_bytes") and not options.get("data_quota_files"):
            return
        now = time.monotonic()
        if upload.measured is None or now - upload.measured_at >= REMEASURE_S:
            try:
                upload.measured = quota.usage(int(options.get("data_quota_files") or 1 << 30))
            except quota.Unmeasurable as exc:
                raise QuotaError(f"nothing was written: the use of /mnt/data cannot be measured ({exc})") from None
            upload.measured_size, upload.measured_at = upload.size, now
        grown = upload.size - upload.measured_size
        over = quota.quota_error(options, extra_bytes=grown + extra, measured=upload.measured)
        if over:
            raise QuotaError(f"nothing was written: {over}")

    def commit(self, upload: Upload) -> Placed:
        os.fsync(upload.fd)
        os.close(upload.fd)
        upload.fd = -1
        name = upload.parts[-1]
        with as_sandbox_user():
            target = open_dir(upload.parts[:-1], create=True)
            try:
                check_target(target, name, "/".join(upload.parts))
                os.rename(upload.id, name, src_dir_fd=upload.staging_fd, dst_dir_fd=target)
                os.fsync(target)
                st = os.stat(name, dir_fd=target, follow_symlinks=False)
            finally:
                os.close(target)
        self.abort(upload.id)  # the staging file is gone already: this closes and tidies up
        return Placed("/".join(upload.parts), st)

    def abort(self, upload_id: str) -> None:
        """Forget an upload and remove its staging file (nothing happens for an unknown id)."""
        upload = self.open.pop(upload_id, None)
        if upload is None:
            return
        if upload.fd >= 0:
            os.close(upload.fd)
        with as_sandbox_user():
            with contextlib.suppress(OSError):
                os.unlink(upload.id, dir_fd=upload.staging_fd)
            os.close(upload.staging_fd)
            if not self.open:
                _remove_staging_dir()

    def abort_all(self) -> None:
        for upload_id in list(self.open):
            self.abort(upload_id)


def place_export(parts: list[str]) -> Placed:
    """Put the notebook the worker exported in place at ``parts`` (an atomic rename, then fsync)."""
    with as_sandbox_user():
        source = open_dir([RESERVED])
        try:
            target = open_dir(parts[:-1], create=True)
            try:
                check_target(target, parts[-1], "/".join(parts))
                os.rename(EXPORT_TEMP, parts[-1], src_dir_fd=source, dst_dir_fd=target)
                os.fsync(target)
                st = os.stat(parts[-1], dir_fd=target, follow_symlinks=False)
            finally:
                os.close(target)
        except OSError as exc:
            raise file_error(exc, "/".join(parts)) from exc
        finally:
            os.close(source)
    return Placed("/".join(parts), st)


def discard_export() -> None:
    """Remove the notebook the worker exported (one that may not be put in place)."""
    with contextlib.suppress(OSError, FileError), as_sandbox_user():
        source = open_dir([RESERVED])
        try:
            os.unlink(EXPORT_TEMP, dir_fd=source)
        finally:
            os.close(source)


def _remove_staging_dir() -> None:
    """rmdir /mnt/data/.mcpx-uploads when empty (call as the sandbox user)."""
    with contextlib.suppress(OSError):
        root = open_dir([])
        try:
            os.rmdir(STAGING, dir_fd=root)
        finally:
            os.close(root)


def purge_staging() -> None:
    """Remove staging files a container that died mid-upload left (when no upload is open)."""
    with as_sandbox_user():
        try:
            staging = open_dir([STAGING])
        except (FileError, OSError):
            return
        try:
            with os.scandir(staging) as entries:
                for count, entry in enumerate(entries):
                    if count >= PURGE_LIMIT:
                        break
                    with contextlib.suppress(OSError):
                        os.unlink(entry.name, dir_fd=staging)
        except OSError:
            pass
        finally:
            os.close(staging)
        _remove_staging_dir()
