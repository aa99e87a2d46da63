"""Looking into and loading a session worker's namespace: ``restore`` and ``variables``.

Both run in the session's own worker, as the sandbox user, and both run user code in bounded
time: unpickling a record (its ``__reduce__``) and a value's ``__repr__``. A Python-level hang is
cut by SIGALRM here; one that never returns to the interpreter is the supervisor's to end (it
bounds every request to a worker and replaces a worker that does not answer).
"""

from __future__ import annotations

import os
import reprlib
import signal
import struct
import time
from typing import Any

from .. import events
from . import packages, snapshot_format
from .snapshots import user_names

RECORD_LOAD_S = 5.0  # per record, plus a second for every 50 MB it holds
REPR_S = 0.5
VARIABLES_S = 5.0  # the whole answer
ANSWER_MAX = 900_000  # bytes of JSON: within the result pipe's frame cap (protocol.MAX_WORKER_HEADER)
NAMES_IN_NOTE = 20


def restore(namespace: dict[str, Any]) -> dict[str, Any]:
    """Load the snapshot into ``namespace``; the ``restored`` frame (never raises for a bad file)."""
    packages.activate()  # the session's installed packages import before their objects load
    path = f"{snapshot_format.DIR}/{snapshot_format.FILE}"
    try:
        stream = open(path, "rb")  # noqa: SIM115 - closed below
    except FileNotFoundError:
        return answer("none", 0, [], "no snapshot of this session's variables was found", None)
    except OSError as exc:
        note = f"the snapshot could not be opened ({exc.strerror}); the session starts empty"
        return answer("failed", 0, [], note, None)
    loaded: list[str] = []
    failed: list[str] = []
    problem = ""
    manifest: dict[str, Any] = {"skipped": [], "taken_at": None, "cwd": None, "python": ""}
    with stream:
        size = os.fstat(stream.fileno()).st_size
        try:
            manifest, end = snapshot_format.manifest_of(stream, size)
        except (snapshot_format.Damaged, OSError, ValueError, OverflowError, struct.error) as exc:
            problem, end = f"{exc}", size
        try:
            for name, data, buffers in snapshot_format.records(stream, end):
                limit = RECORD_LOAD_S + sum(len(b) for b in buffers) / 50e6
                try:
                    value = snapshot_format.load_record(data, buffers, limit)
                except snapshot_format.LoadTimeout:
                    failed.append(f"{name[:100]} (took longer than {limit:.0f} s to load)")
                    continue
                except BaseException as exc:  # noqa: BLE001 - a record is user code: anything, SystemExit too
                    failed.append(f"{name[:100]} (could not be loaded: {type(exc).__name__}: {str(exc)[:80]})")
                    continue
                if name.isidentifier():
                    namespace[name] = value
                    loaded.append(name)
        except (snapshot_format.Damaged, OSError, ValueError, OverflowError, struct.error) as exc:
            problem = problem or f"{exc}"
    moved = _chdir(manifest.get("cwd"))
    outcome = "failed" if problem and not loaded else "restored"  # a damaged file that gave nothing back
    note = _note(loaded, manifest, failed, problem, moved)
    return answer(outcome, len(loaded), [*manifest["skipped"], *failed], note, manifest["taken_at"])


def _chdir(cwd: Any) -> str:
    if not isinstance(cwd, str) or cwd == os.getcwd():
        return ""
    try:
        os.chdir(cwd)
    except (OSError, ValueError):
        return f"; its working directory {cwd[:200]!r} is gone"
    return ""


def _note(loaded: list[str], manifest: dict[str, Any], failed: list[str], problem: str, moved: str) -> str:
    taken_at = manifest.get("taken_at")
    when = f" of {time.strftime('%H:%M:%S', time.gmtime(taken_at))} UTC" if taken_at else ""
    note = f"restored {len(loaded)} names from the snapshot{when}"
    if problem:
        note += f"; the snapshot is damaged ({problem}): only what came before that was loaded"
    skipped = manifest.get("skipped", [])
    if skipped:
        note += "; not kept: " + _names(skipped)
    if failed:
        note += "; not loaded: " + _names(failed)
    python = manifest.get("python")
    if python and python != snapshot_format.python_version():
        note += f"; it was taken under Python {python}"
    return (note + moved)[:4000]


def _names(items: list[str]) -> str:
    shown = ", ".join(items[:NAMES_IN_NOTE])
    return shown + (f" and {len(items) - NAMES_IN_NOTE} more" if len(items) > NAMES_IN_NOTE else "")


def answer(outcome: str, restored: int, skipped: list[str], note: str, taken_at: float | None) -> dict[str, Any]:
    return events.worker_restored(outcome, restored, skipped[:1000], note, taken_at)


# -- variables --------------------------------------------------------------------------------------
class ReprTimeout(BaseException):
    pass


def _on_alarm(signum: int, frame: Any) -> None:
    raise ReprTimeout


def variables(shell: Any, limit: int, repr_chars: int) -> dict[str, Any]:
    """The ``variables`` frame: each user name's type, short repr, size and shape, within the caps."""
    names = sorted(user_names(shell))
    limit = max(0, min(limit, 10_000))
    repr_chars = max(10, min(repr_chars, 4000))
    shortener = reprlib.Repr()
    shortener.maxstring = shortener.maxother = repr_chars
    out: list[dict[str, Any]] = []
    used = 0
    deadline = time.monotonic() + VARIABLES_S
    previous = signal.signal(signal.SIGALRM, _on_alarm)
    try:
        for name in names[:limit]:
            if used > ANSWER_MAX or time.monotonic() > deadline:
                break
            item = describe(name, shell.user_ns.get(name), shortener, repr_chars)
            used += len(str(item)) + 64
            out.append(item)
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
        signal.signal(signal.SIGALRM, previous)
    return events.worker_variables(out, len(out) < len(names))


def describe(name: str, value: Any, shortener: reprlib.Repr, repr_chars: int) -> dict[str, Any]:
    kind = type(value)
    item: dict[str, Any] = {"name": name[:1000], "type": f"{kind.__module__}.{kind.__qualname__}"[:1000]}
    signal.setitimer(signal.ITIMER_REAL, REPR_S)
    try:
        text = shortener.repr(value)
    except ReprTimeout:
        text = f"<repr took longer than {REPR_S} s>"
    except BaseException as exc:  # noqa: BLE001 - a user's __repr__ may raise anything
        text = f"<repr failed: {type(exc).__name__}>"
    finally:
        signal.setitimer(signal.ITIMER_REAL, 0)
    item["repr"] = text if len(text) <= repr_chars else text[: repr_chars - 3] + "..."
    try:
        item["size"], item["shape"] = _size_and_shape(value)
    except BaseException:  # noqa: BLE001 - attributes of user objects are user code too
        item["size"], item["shape"] = None, None
    return item


def _size_and_shape(value: Any) -> tuple[int | None, list[int] | None]:
    """Bytes and shape where they are cheap to know: numpy's nbytes, pandas' shallow memory use."""
    import sys

    numpy, pandas = sys.modules.get("numpy"), sys.modules.get("pandas")
    shape = None
    if numpy is not None and isinstance(value, numpy.ndarray):
        return int(value.nbytes), [int(n) for n in value.shape][:32]
    if pandas is not None and isinstance(value, pandas.DataFrame | pandas.Series):
        used = value.memory_usage(deep=False)
        size = int(used.sum()) if hasattr(used, "sum") else int(used)
        return size, [int(n) for n in value.shape]
    size = sys.getsizeof(value)
    return (int(size) if isinstance(size, int) and size >= 0 else None), shape
