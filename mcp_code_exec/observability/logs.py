"""Log lines as text or as JSON objects, one a line, on stderr. A session or run id is never
written as it is (``logged_id``).

JSON lines carry ``time`` (UTC, ISO 8601), ``level``, ``logger``, ``message`` and, within a traced
call, ``trace_id``, so a log line and the call's spans meet in the operator's tools. A line logged
with ``extra={"fields": {...}}`` (code mode's audit) has those fields as keys of its own too.
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
import sys
from typing import Literal

from .tracing import current_trace_id

TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
LogFormat = Literal["text", "json"]


def logged_id(value: str) -> str:
    """How a session or run id appears in a log line: a short hash (``#`` and 12 hex digits), never
    the id itself. An operator who knows an id finds its lines with the same hash; a log reader
    learns no id."""
    return "#" + hashlib.sha256(("mcp-code-exec log\0" + value).encode("utf-8", "surrogatepass")).hexdigest()[:12]


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        line: dict[str, object] = {
            "time": datetime.datetime.fromtimestamp(record.created, datetime.UTC).isoformat(timespec="milliseconds"),
            "level": record.levelname.lower(),
            "logger": record.name,
            "message": record.getMessage(),
        }
        fields = getattr(record, "fields", None)  # a structured line (code mode's audit): its fields as keys
        if isinstance(fields, dict):
            line.update({key: value for key, value in fields.items() if key not in line})
        trace_id = current_trace_id()
        if trace_id is not None:
            line["trace_id"] = trace_id
        if record.exc_info:
            line["exception"] = self.formatException(record.exc_info)
        return json.dumps(line, ensure_ascii=False, default=str)


def setup(level: str, log_format: LogFormat = "text") -> None:
    """The root logger on stderr, in ``log_format`` (stdout belongs to the stdio protocol)."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(JsonFormatter() if log_format == "json" else logging.Formatter(TEXT_FORMAT))
    logging.basicConfig(level=getattr(logging, level.upper()), handlers=[handler])
