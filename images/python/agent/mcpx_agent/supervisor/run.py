"""One run inside the supervisor: feed the worker its cell, move its output, judge how it ended.

Everything read from the worker's result pipe is hostile (user code holds that descriptor):
``forward`` accepts only the frames ``protocol.worker_frame`` allows, caps them again, and a
violation stops the run. Nothing from the worker is passed on as it came: each event to the
host is built here from checked values.
"""

from __future__ import annotations

import os
import select
import signal
import time
from typing import Any

from .. import meter, protocol
from ..output import Capture, Streamer, clip_text
from ..zygote.zygote import WorkerHandle

INTERRUPT_GRACE_S = 1.0
PAUSED_WAKE_S = 60.0  # while a call waits for approval the deadline is held; the host bounds the wait
EXIT_STATUS_WAIT_S = 1.0  # how long a worker whose result pipe closed may take to be reported gone
MAX_WORKER_NOTES = 4
MAX_TABLES = 8  # table references a run may send (the worker keeps as many)
TABLE_FIELDS = ("table", "columns", "dtypes", "rows", "total_rows", "sorted_columns")
STATUS_OF_REASON = {"timeout": "timeout", "cancelled": "cancelled", "disk_quota": "error", "violation": "error"}
DEFAULTS = {
    "max_output_bytes": 65536,
    "max_result_bytes": 65536,
    "max_display_bytes": 65536,
    "max_displays": 50,
    "max_images": 20,
    "max_image_bytes": 1_000_000,
    "max_image_pixels": 2_000_000,
}


def option(options: dict[str, Any], name: str) -> int:
    value = options.get(name, DEFAULTS[name])
    return value if isinstance(value, int) and not isinstance(value, bool) and value > 0 else DEFAULTS[name]


class RunState:
    """One run, from the cell's arrival to its outcome (a plain class: see ``zygote.WorkerHandle``)."""

    def __init__(
        self,
        request_id: int,
        handle: WorkerHandle,
        *,
        session: bool,
        deadline: float,
        options: dict[str, Any],
        stdout: Capture,
        stderr: Capture,
        streamer: Streamer | None,
        next_quota_check: float,
    ) -> None:
        self.request_id = request_id
        self.handle = handle
        self.session = session
        self.deadline = deadline
        self.options = options
        self.stdout = stdout
        self.stderr = stderr
        self.streamer = streamer
        self.next_quota_check = next_quota_check
        self.done: dict[str, Any] | None = None
        self.exited: int | None = None  # wait status once the worker is known to be gone
        self.results_closed_at: float | None = None
        self.interrupted_at: float | None = None
        self.reason: str | None = None  # "timeout", "cancelled", "disk_quota" or "violation" once we stop it
        self.quota_message: str | None = None  # why the quota stopped it, as measured then
        self.violation = ""
        self.images = self.displays = self.display_bytes = 0
        self.truncated: set[str] = set()
        self.tables = 0
        self.notes: list[str] = []  # the worker's (its snapshot's): bounded, and labelled as the session's
        # What the run displayed, for the session's history: ("display", text, b"") or ("image", mime, bytes).
        self.kept: list[tuple[str, Any, bytes]] | None = [] if options.get("history_max_bytes") else None
        self.results = protocol.FrameReader(
            handle.results,
            max_header=protocol.MAX_WORKER_HEADER,
            max_payload=max(option(options, "max_image_bytes"), protocol.MAX_CALL_PAYLOAD),
        )
        self.control_out = bytearray()  # answers to tool calls not yet written to the worker's control pipe
        self.pauses = 0  # tool calls waiting for a human's approval (the run's clock stands still meanwhile)
        self.paused_at: float | None = None
        self.calls = 0  # tool calls the cell made
        self.cpu_before = meter.cpu_us()
        self.wheels = shipped_wheels()  # what the host copied in for this run

    @property
    def finished(self) -> bool:
        return self.done is not None or self.exited is not None


def forward(state: RunState, header: dict[str, Any], payload: bytes, send: Any) -> None:
    """Check one frame from the worker and pass on what it may say (``ProtocolError`` otherwise)."""
    frame = protocol.worker_frame(header, payload, option(state.options, "max_image_bytes"))
    kind = frame["kind"]
    if kind == "done":
        state.done = frame
        state.truncated.update(frame.get("truncated", []))
    elif kind == "call":
        state.calls += 1
        call = {"ev": "tool_call", "id": state.request_id, "call": frame["call"], "server": frame["server"]}
        send({**call, "tool": frame["tool"], "raw": bool(frame.get("raw", False))}, payload)
    elif kind == "note":
        if len(state.notes) < MAX_WORKER_NOTES:
            state.notes.append(clip_text(frame["text"], 1000)[0])
    elif kind == "table":
        if state.tables < MAX_TABLES:
            state.tables += 1
            send({**{key: frame[key] for key in TABLE_FIELDS}, "ev": "table", "id": state.request_id})
            if state.kept is not None:
                state.kept.append(("table", {key: frame[key] for key in TABLE_FIELDS}, b""))
    elif kind not in ("image", "display"):
        raise protocol.ProtocolError(f"{kind}: not during a run")
    elif kind == "image":
        size = protocol.image_size(frame["mime"], payload)
        pixels_ok = size is not None and size[0] * size[1] <= option(state.options, "max_image_pixels")
        if state.images >= option(state.options, "max_images") or not pixels_ok:
            state.truncated.add("images")
            return
        assert size is not None
        state.images += 1
        note = frame.get("note")
        event: dict[str, Any] = {"ev": "image", "id": state.request_id, "mime": frame["mime"]}
        event.update(width=size[0], height=size[1], note=clip_text(note, 1024)[0] if note else None)
        send(event, payload)
        if state.kept is not None:
            state.kept.append(("image", frame["mime"], payload))
    else:
        budget = option(state.options, "max_display_bytes") - state.display_bytes
        if state.displays >= option(state.options, "max_displays") or budget <= 0:
            state.truncated.add("displays")
            return
        text, cut = clip_text(frame["text"], budget, "display output")
        if cut:
            state.truncated.add("displays")
        state.displays += 1
        state.display_bytes += len(text.encode("utf-8", "replace"))
        send({"ev": "display", "id": state.request_id, "text": text})
        if state.kept is not None:
            state.kept.append(("display", text, b""))


def read_results(state: RunState, send: Any) -> None:
    """Read and forward the worker's frames; a violation marks the run to be stopped."""
    if state.results.eof or state.reason == "violation":
        return
    try:
        state.results.fill()
        for header, payload in state.results.frames():
            forward(state, header, payload, send)
    except protocol.ProtocolError as exc:
        state.reason = "violation"
        state.violation = str(exc)[:300]
    if state.results.eof and state.results_closed_at is None:
        state.results_closed_at = time.monotonic()


def held_deadline(state: RunState, at: float) -> float:
    """While a tool call waits for a human's approval the run's time stands still (the host bounds the wait)."""
    return time.monotonic() + PAUSED_WAKE_S if state.paused_at is not None and state.interrupted_at is None else at


def tool_messages(state: RunState, messages: list[tuple[dict[str, Any], bytes]]) -> None:
    for request, payload in messages:
        tool_message(state, request, payload)


def tool_message(state: RunState, request: dict[str, Any], payload: bytes) -> None:
    """The host answered a tool call (queued for the worker's control pipe) or paused or resumed the
    run's clock while a human is asked (approval waits do not count against the run's timeout)."""
    if request.get("op") == "tool_pause":
        now = time.monotonic()
        if request.get("paused") is True:
            state.pauses += 1
            state.paused_at = now if state.paused_at is None else state.paused_at
        elif state.pauses > 0:
            state.pauses -= 1
            if state.pauses == 0 and state.paused_at is not None:
                state.deadline += now - state.paused_at
                state.paused_at = None
        return
    header = {"kind": "tool_result", "call": request.get("call"), "ok": request.get("ok") is True}
    header["error"] = request.get("error")
    state.control_out += protocol.encode(header, payload)
    flush_control(state)


def flush_control(state: RunState) -> None:
    """Write what the control pipe takes now (the worker reads it when it waits for the answer)."""
    os.set_blocking(state.handle.control, False)
    while state.control_out:
        try:
            written = os.write(state.handle.control, state.control_out[: 1 << 16])
        except BlockingIOError:
            return
        except OSError:
            state.control_out.clear()  # the worker is gone; its end is reported as usual
            return
        del state.control_out[:written]


def read_output(state: RunState, name: str) -> bool:
    """Move what the worker printed to ``name`` into its capture; False once the pipe is closed."""
    fd = getattr(state.handle, name)
    capture: Capture = getattr(state, name)
    for _ in range(64):  # bounded, so one chatty stream cannot starve the deadline check
        try:
            chunk = os.read(fd, 1 << 16)
        except BlockingIOError:
            return True
        except OSError:
            return False
        if not chunk:
            return False
        capture.add(chunk)
        if state.streamer is not None:
            state.streamer.add(name, chunk)
    return True


def send_cell(handle: WorkerHandle, header: dict[str, Any], code: bytes, deadline: float) -> bool:
    """Write the cell to the worker's control pipe; False if it is gone or stops reading."""
    data = memoryview(protocol.encode(header, code))
    os.set_blocking(handle.control, False)
    while data:
        try:
            data = data[os.write(handle.control, data) :]
            continue
        except BlockingIOError:
            pass
        except OSError:
            return False
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            return False
        select.select([], [handle.control], [], remaining)
    return True


def interrupt(state: RunState) -> bool:
    """SIGINT to a session's worker (it keeps its state if the cell honours it); False if gone."""
    state.interrupted_at = time.monotonic()
    try:
        os.kill(state.handle.pid, signal.SIGINT)
    except ProcessLookupError:
        return False
    return True


def worker_status(state: RunState, oom_before: int | None, oom_after: int | None) -> tuple[str, dict[str, Any] | None]:
    """(status, error) of a run whose worker ended without saying it was done."""
    if state.reason == "violation":
        message = (
            "the run wrote data that is not a valid result frame to the sandbox's result channel (fd 3): "
            f"{state.violation}; its interpreter was stopped"
        )
        return "error", {"type": "SandboxProtocolError", "message": message, "traceback": ""}
    if state.reason is not None:
        return STATUS_OF_REASON.get(state.reason, "error"), None
    wait_status = state.exited if state.exited is not None and state.exited >= 0 else 0
    signalled = os.WIFSIGNALED(wait_status)
    signum = os.WTERMSIG(wait_status) if signalled else None
    oom = (oom_before is not None and oom_after is not None and oom_after > oom_before) or (
        oom_after is None and signum == signal.SIGKILL
    )
    if oom:
        message = "the run exceeded the sandbox's memory limit and was killed"
        return "memory_limit", {"type": "MemoryLimit", "message": message, "traceback": ""}
    if signum:
        message = f"the Python process died with signal {signal.Signals(signum).name}"
    elif state.exited is None or state.exited < 0:
        message = "the Python process closed its result channel and was stopped"
    else:
        message = f"the Python process exited with code {os.WEXITSTATUS(wait_status)}"
    return "crashed", {"type": "Crashed", "message": message, "traceback": ""}


def done_status(state: RunState) -> tuple[str, dict[str, Any] | None]:
    """(status, error) of a run whose worker said it was done."""
    assert state.done is not None
    status = state.done["status"]
    if status == "interrupted":
        status = STATUS_OF_REASON.get(state.reason or "", "error")
    error = state.done["error"]
    if error is not None:
        cap = option(state.options, "max_result_bytes")
        error = {**error, **{name: clip_text(error[name], cap, "traceback")[0] for name in ("message", "traceback")}}
    return status, error


WHEELHOUSE = "/mnt/data/.wheelhouse"  # the worker's packages.WHEELHOUSE
MAX_PEAK_KIB = 1 << 40


def shipped_wheels() -> int:
    try:
        return sum(1 for name in os.listdir(WHEELHOUSE) if name.endswith(".whl"))
    except OSError:
        return 0


def usage(state: RunState, files: list[dict[str, Any]]) -> dict[str, Any]:
    """What the run cost: the container's CPU since the cell arrived (the kernel's, never the
    worker's word), the worker's peak memory as its kernel kept it, the files it left."""
    user, system = meter.cpu_us()
    done = state.done or {}
    peaks = [done.get(name) for name in ("peak_kib", "children_peak_kib")]
    peak = max((p for p in peaks if isinstance(p, int) and 0 < p < MAX_PEAK_KIB), default=None)
    return {
        "cpu_user_s": round(max(0, user - state.cpu_before[0]) / 1e6, 6),
        "cpu_system_s": round(max(0, system - state.cpu_before[1]) / 1e6, 6),
        "peak_memory_bytes": None if peak is None else peak * 1024,
        "data_written_bytes": sum(entry["size"] for entry in files),
        "packages_installed": state.wheels,
        "tool_calls": state.calls,
    }


def done_header(
    state: RunState, status: str, error: Any, *, restarted: bool, started: float, notes: list[str]
) -> dict[str, Any]:
    """The ``done`` event for the host, built from checked values only."""
    cut = {name for name in ("stdout", "stderr") if getattr(state, name).truncated}
    return {
        "ev": "done",
        "id": state.request_id,
        "status": status,
        "result": (state.done or {}).get("result"),
        "error": error,
        "stdout": state.stdout.text(),
        "stderr": state.stderr.text(),
        "truncated": sorted({*state.truncated, *cut}),
        "session_restarted": restarted,
        "duration_ms": round((time.monotonic() - started) * 1000, 3),
        "notes": [*notes, *(f"(from the session's sandbox) {note}" for note in state.notes)][:16],
        "recycle": status not in ("ok", "error") or state.reason == "violation",
    }
