"""The parts of a run's outcome that are not the run itself: the error sentences a run ends with
when the tool failed under it, file entries as the client sees them, and whether a session run
reports its interpreter restarted."""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import TypeVar

from ..errors import EngineError, SandboxError, SandboxLost
from ..models import ErrorInfo, FileInfo, RestoreOutcome, RunResult
from ..protocol import messages as wire
from .uris import TEXT_MIMES, as_text, guess_mime

log = logging.getLogger(__name__)
# The files a run's result names; past these it counts them ("and N more"): a run may change
# thousands, and each result is kept in the server's memory until fetched (runs.max_kept_mb).
RESULT_FILES_MAX = 100
Entry = TypeVar("Entry")


def shown_files(entries: Sequence[Entry]) -> tuple[Sequence[Entry], int]:
    """The files a result names, and how many more it only counts."""
    return entries[:RESULT_FILES_MAX], max(0, len(entries) - RESULT_FILES_MAX)


def file_info(uri: str, entry: wire.FileEntry | wire.Written) -> FileInfo:
    return FileInfo(
        path=entry.path, size=entry.size, modified=entry.modified, uri=uri, mime_type=guess_mime(entry.path)
    )


def container_lost_error(exc: SandboxLost) -> ErrorInfo:
    """The error of a run whose container was lost under it (died, or its engine stopped answering)."""
    return ErrorInfo(type="SandboxLost", message=f"{exc}; the run's state was lost", tool_failure=True)


def failed(exc: Exception) -> ErrorInfo:
    """The tool failed under the run (the engine, a container start): its sentence, for the model."""
    if isinstance(exc, SandboxError):
        # From the error tree, never from a name: user code can raise an exception called anything.
        tool_failure = isinstance(exc, EngineError | SandboxLost)
        return ErrorInfo(type=type(exc).__name__, message=str(exc), tool_failure=tool_failure)
    log.error("a run failed inside the server", exc_info=exc)
    return ErrorInfo(type="InternalError", message="the server failed to run this; see its log", tool_failure=True)


def closed() -> ErrorInfo:
    return ErrorInfo(type="SessionClosed", message="the session was closed while this run was going")


def cancelled() -> ErrorInfo:
    return ErrorInfo(type="Cancelled", message="the run was cancelled before it ended")


EMBED_TEXT_MAX = 4096  # a stateless run's text file this small goes inline with its result


def small_text(data: bytes, mime: str) -> str | None:
    """Text small enough to hand a model inline with a run's result."""
    if len(data) > EMBED_TEXT_MAX or not mime.startswith(TEXT_MIMES):
        return None
    return as_text(data, mime)


def restarted(result: RunResult, variables_gone: bool, restore: RestoreOutcome | None) -> RunResult:
    """The one place a session run's ``session_restarted`` is decided: its container was lost since a
    run last said so, the restore in a new container brought no variables back, or the agent replaced
    the session's interpreter (``result.session_restarted`` as the agent said it: its worker died
    between runs or in this one, or a flood stopped it). ``result.restore`` keeps what the session's
    variables now come from, for the answer's wording: the restore's outcome, unless the agent's
    interpreter was replaced after it (nothing came back then)."""
    replaced_by_agent = result.session_restarted
    result.restore = None if replaced_by_agent else restore
    result.session_restarted = replaced_by_agent or variables_gone or restore in ("none", "failed")
    return result


@dataclass
class Said:
    """What a session says to the run that takes it up, taken from the session once (its
    container lost since a run last said so, the restore in a new container, the notes it kept): the
    run's answer says it whatever way the run ends, cancelled included, or no answer would."""

    variables_gone: bool = False
    restore: RestoreOutcome | None = None
    notes: list[str] = field(default_factory=list)

    def told(self, result: RunResult) -> RunResult:
        result.notes = self.notes + result.notes
        return restarted(result, self.variables_gone, self.restore)
