"""Tracebacks as a notebook shows them, made fast: IPython's "Context" shape without stack_data,
and the error as the result frame carries it."""

from __future__ import annotations

import linecache
import os
import sys
import traceback
from types import TracebackType
from typing import Any

from IPython.core.ultratb import AutoFormattedTB

AGENT_DIR = os.path.dirname(os.path.abspath(__file__)) + os.sep
HIDDEN_FILES = (os.path.join("IPython", "core", "interactiveshell.py"),)
CAUSE = "The above exception was the direct cause of the following exception:"
CONTEXT = "During handling of the above exception, another exception occurred:"


class QuickContextTB(AutoFormattedTB):
    """IPython's "Context" tracebacks without stack_data, which re-parses every file in the stack
    (tens of milliseconds for a cell, far more through pandas). Same shape: each frame's location
    and a few lines around the failing one; frames of the agent and the shell are left out.
    Other modes (``%xmode Verbose``) are IPython's own."""

    def structured_traceback(
        self,
        etype: Any = None,
        value: Any = None,
        tb: Any = None,
        tb_offset: int | None = None,
        number_of_lines_of_context: int = 5,
    ) -> list[str]:
        if self.mode != "Context":
            return super().structured_traceback(etype, value, tb, tb_offset, number_of_lines_of_context)  # type: ignore[no-any-return]
        if etype is None:
            etype, value, tb = sys.exc_info()
        if isinstance(tb, tuple):
            tb = tb[0]
        self.tb = tb
        offset = self.tb_offset if tb_offset is None else tb_offset
        try:
            return format_chain(value, tb, offset or 0)
        except Exception:  # noqa: BLE001 - never lose the error over its formatting
            return traceback.format_exception_only(etype, value)


def format_chain(value: BaseException, tb: TracebackType | None, offset: int) -> list[str]:
    """The exception and what caused it, oldest first, as ``traceback`` would chain them."""
    chain: list[tuple[BaseException, TracebackType | None, int, str | None]] = []
    seen: set[int] = set()
    current: BaseException | None = value
    link: str | None = None
    while current is not None and id(current) not in seen and len(chain) < 32:
        seen.add(id(current))
        outermost = current is value
        chain.append((current, tb if outermost else current.__traceback__, offset if outermost else 0, link))
        if current.__cause__ is not None:
            current, link = current.__cause__, CAUSE
        elif current.__context__ is not None and not current.__suppress_context__:
            current, link = current.__context__, CONTEXT
        else:
            current = None
    lines: list[str] = []
    for exc, exc_tb, skip, link_text in reversed(chain):
        lines.extend(format_one(exc, exc_tb, skip))
        if link_text is not None:
            lines += ["", link_text, ""]
    return lines


def format_one(value: BaseException, tb: TracebackType | None, skip: int) -> list[str]:
    name = type(value).__name__
    lines = ["-" * 75, name + "Traceback (most recent call last)".rjust(75 - len(name))]
    for index, (frame, lineno) in enumerate(traceback.walk_tb(tb)):
        filename = frame.f_code.co_filename
        if index < skip or filename.startswith(AGENT_DIR) or filename.endswith(HIDDEN_FILES):
            continue
        lines.append(frame_location(filename, lineno, frame.f_code.co_name))
        lines.extend(context_lines(filename, lineno, frame.f_globals))
        lines.append("")
    lines.extend(part.rstrip("\n") for part in traceback.format_exception_only(type(value), value))
    return lines


def frame_location(filename: str, lineno: int, function: str) -> str:
    from IPython.core.getipython import get_ipython

    cells = getattr(getattr(get_ipython(), "compile", None), "_filename_map", {})
    where = f"Cell In[{cells[filename]}], line {lineno}" if filename in cells else f"File {filename}:{lineno}"
    return where if function == "<module>" else f"{where}, in {function}"


def context_lines(filename: str, lineno: int, module_globals: dict[str, Any], around: int = 2) -> list[str]:
    lines = []
    for number in range(max(1, lineno - around), lineno + around + 1):
        text = linecache.getline(filename, number, module_globals).rstrip()
        if number == lineno and text:
            marker = "-" * max(1, 7 - len(str(number)) - 2) + "> "
            lines.append(f"{marker}{number} {text}")
        elif text.strip():
            lines.append(f"{number:>7} {text}")
    return lines


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


# A cell that IPython would run unchanged: no magic, shell escape, help or prompt syntax at the
# start of any line (autocall escapes too), and no "?" anywhere (help). When in doubt: IPython.
