"""The audit logger's structured lines into the audit log: anything logged on ``mcp_code_exec.audit``
with ``extra={"fields": {...}}`` (code mode's calls, sign-ins) is recorded (``attach``); ``require``
refuses what the attached logs must record and cannot."""

from __future__ import annotations

import logging

from .audit import AUDIT_LOGGER, AuditLog


class AuditHandler(logging.Handler):
    """Records what is logged on the audit logger with ``fields`` into every attached log, whatever
    the server's log level; the line still reaches the server's own log as that level says."""

    def __init__(self, shown: int) -> None:
        super().__init__(logging.INFO)
        self.logs: list[AuditLog] = []
        self.shown = shown  # the level the audit logger had: what still goes on to the server's log

    def emit(self, record: logging.LogRecord) -> None:
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            event = str(fields.get("event") or record.getMessage().split(" ", 1)[0])
            for audit in list(self.logs):
                audit.record(event, **{key: value for key, value in fields.items() if key != "event"})
        parent = logging.getLogger(AUDIT_LOGGER).parent
        if record.levelno >= self.shown and parent is not None:
            parent.handle(record)


_handler: AuditHandler | None = None


def attach(audit: AuditLog) -> None:
    """Record the audit logger's structured lines into ``audit`` too (until ``detach``)."""
    global _handler
    if not audit.enabled:
        return
    logger = logging.getLogger(AUDIT_LOGGER)
    if _handler is None:
        _handler = AuditHandler(logger.getEffectiveLevel())
        logger.addHandler(_handler)
        logger.setLevel(logging.INFO)
        logger.propagate = False  # the handler passes on what the server's log level shows
    _handler.logs.append(audit)


def require() -> None:
    """``AuditUnavailable`` while an attached log must record and cannot (``AuditLog.require``): for
    what records through the audit logger and acts on its own (code mode's calls)."""
    for audit in list(_handler.logs) if _handler is not None else []:
        audit.require()


def detach(audit: AuditLog) -> None:
    global _handler
    if _handler is None or audit not in _handler.logs:
        return
    _handler.logs.remove(audit)
    if not _handler.logs:
        logger = logging.getLogger(AUDIT_LOGGER)
        logger.removeHandler(_handler)
        logger.setLevel(logging.NOTSET)
        logger.propagate = True
        _handler = None
