"""The notebook shell that runs user code inside a worker.

Built once in the supervisor (before any fork, so every worker starts from the same pristine,
already-imported state) but only ever *used* inside a worker that has dropped to uid 1000.
Displays, the last expression's value, figures and tracebacks are captured into a ``Sink`` that
streams them as frames on the worker's result pipe instead of printing them.
"""

from __future__ import annotations

import base64
import io
import re
import sys
from typing import Any

from IPython.core.displayhook import DisplayHook
from IPython.core.displaypub import DisplayPublisher
from IPython.core.interactiveshell import InteractiveShell
from traitlets.config import Config

from . import protocol

ANSI = re.compile(r"\x1b\[[0-9;]*[A-Za-z]")
IMAGE_MIMES = ("image/png", "image/jpeg")


class Sink:
    """Where a worker's rich output goes: frames on the result pipe, sent as they happen."""

    def __init__(self) -> None:
        self.fd: int | None = None
        self.options: dict[str, Any] = {}
        self.result_text: str | None = None
        self.error: dict[str, Any] | None = None
        self.images = 0

    def reset(self, fd: int, options: dict[str, Any]) -> None:
        self.fd = fd
        self.options = options
        self.result_text = None
        self.error = None
        self.images = 0

    def send(self, header: dict[str, Any], payload: bytes = b"") -> None:
        if self.fd is not None:
            protocol.send(self.fd, header, payload)

    def display(self, data: dict[str, Any], *, is_result: bool = False) -> None:
        for mime in IMAGE_MIMES:
            if mime in data:
                raw = data[mime]
                blob = base64.b64decode(raw) if isinstance(raw, str) else bytes(raw)
                self.image(blob, mime)
                if not is_result:
                    return
        text = data.get("text/plain")
        if text is None:
            return
        text = ANSI.sub("", str(text))
        if is_result:
            self.result_text = text
        else:
            self.send({"kind": "text", "text": text})

    def image(self, blob: bytes, mime: str) -> None:
        from .images import fit_image

        self.images += 1
        fitted, width, height, note = fit_image(blob, mime, self.options)
        if note and self.options.get("keep_originals"):
            note += "; " + keep_original(blob, mime, self.images)
        header = {"kind": "image", "mime": fitted[1], "width": width, "height": height}
        if note:
            header["note"] = note
        self.send(header, fitted[0])


def keep_original(blob: bytes, mime: str, number: int) -> str:
    """In a session, a downscaled image's full-size original is saved next to the user's files."""
    import os
    import time

    name = f"image-{time.strftime('%Y%m%d-%H%M%S')}-{number}.{'png' if mime == 'image/png' else 'jpg'}"
    try:
        os.makedirs("/mnt/data/images", exist_ok=True)
        with open(f"/mnt/data/images/{name}", "wb") as handle:
            handle.write(blob)
    except OSError as exc:
        return f"the original could not be kept ({exc.strerror})"
    return f"original kept as /mnt/data/images/{name}"


SINK = Sink()


class CapturingDisplayHook(DisplayHook):
    """The last expression's value becomes ``result`` instead of an ``Out[n]:`` print."""

    def start_displayhook(self) -> None:
        pass

    def write_output_prompt(self) -> None:
        pass

    def write_format_data(self, format_dict: dict[str, Any], md_dict: Any = None) -> None:
        SINK.display(format_dict, is_result=True)

    def finish_displayhook(self) -> None:
        pass


class CapturingDisplayPublisher(DisplayPublisher):
    def publish(self, data: dict[str, Any], metadata: Any = None, source: Any = None, **_: Any) -> None:
        SINK.display(data)

    def clear_output(self, wait: bool = False) -> None:
        pass


class SandboxShell(InteractiveShell):
    displayhook_class = CapturingDisplayHook
    display_pub_class = CapturingDisplayPublisher

    def _showtraceback(self, etype: type, evalue: BaseException, stb: list[str]) -> None:
        text = ANSI.sub("", "\n".join(stb))
        SINK.error = error_info(etype, evalue, text)

    def init_virtualenv(self) -> None:
        pass


def error_info(etype: type, evalue: BaseException, traceback: str) -> dict[str, Any]:
    info: dict[str, Any] = {
        "type": getattr(etype, "__name__", str(etype)),
        "message": safe_str(evalue),
        "traceback": traceback,
    }
    if isinstance(evalue, SyntaxError):
        info["message"] = evalue.msg or info["message"]
        info["line"] = evalue.lineno
        info["column"] = evalue.offset
    return info


def safe_str(value: object) -> str:
    try:
        return str(value)
    except Exception:  # noqa: BLE001 - a user exception's __str__ may itself raise
        return f"<unprintable {type(value).__name__}>"


def flush_figures() -> None:
    """Send every open matplotlib figure as a PNG and close it (what Jupyter's inline backend does)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    for number in list(pyplot.get_fignums()):
        figure = pyplot.figure(number)
        buffer = io.BytesIO()
        try:
            figure.savefig(buffer, format="png", bbox_inches="tight")
        except Exception as exc:  # noqa: BLE001 - a broken figure must not lose the others
            SINK.send({"kind": "text", "text": f"[figure {number} could not be rendered: {exc}]"})
        else:
            SINK.image(buffer.getvalue(), "image/png")
    pyplot.close("all")


def make_shell() -> SandboxShell:
    config = Config()
    config.HistoryManager.enabled = False
    config.InteractiveShell.colors = "NoColor"
    config.InteractiveShell.autocall = 0
    config.InteractiveShell.xmode = "Context"
    shell = SandboxShell.instance(config=config)
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is not None:
        pyplot.show = lambda *args, **kwargs: flush_figures()
    return shell
