"""The proxy's access records, on the server: metrics, a log line each, the day's counters per
identity (kept on disk, given again to a proxy that restarts), and what a run's result should say.

A record is checked as anything from outside is (the proxy judges hostile traffic, and its host
names come from sandboxes): a record that is not one is dropped. It never holds a path, a query,
a header or a body; the log line holds the identity's and the session's hashes, never either id.

Metrics labels stay bounded: the allow entry is one of the configuration's (else ``other``; none
for a request no entry allowed), and the identity is the hash of an identity the configuration
names (an HTTP token's), ``local`` for every stdio client, ``other`` for the rest.
"""

from __future__ import annotations

import json
import logging
import os
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from pathlib import Path
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError

from ..observability import metrics

log = logging.getLogger("mcp_code_exec.egress")
GRANTS_KEPT = 10_000  # runs whose summary waits for their end
USAGE_FILE = "usage.json"


class AccessRecord(BaseModel):
    model_config = ConfigDict(extra="ignore")

    decision: Literal["allowed", "refused", "cut", "error"]
    identity: str | None = Field(None, max_length=64)
    session: str | None = Field(None, max_length=64)
    grant: str | None = Field(None, max_length=128)
    pattern: str | None = Field(None, max_length=300)
    host: str = Field("-", max_length=300)
    method: str = Field("-", max_length=16)
    status: int | None = None
    up: int = Field(0, ge=0)
    down: int = Field(0, ge=0)
    reason: str | None = Field(None, max_length=600)


@dataclass
class Summary:
    """What one grant's records said so far, for its run's result."""

    requests: int = 0
    refused: int = 0
    bytes: int = 0
    first_refusal: str | None = None
    cut: str | None = None


@dataclass
class Accounting:
    patterns: list[str]
    state_dir: Path | None = None
    labels: dict[str, str] = field(default_factory=dict)  # identity hash -> its metrics label
    day: str = ""
    used: dict[str, int] = field(default_factory=dict)  # identity hash -> bytes this UTC day
    summaries: OrderedDict[str, Summary] = field(default_factory=OrderedDict)
    ended_bytes: OrderedDict[str, int] = field(default_factory=OrderedDict)  # grant -> its run's bytes
    dirty: bool = False

    def label(self, identity_hash: str, label: str) -> None:
        """How the metrics show this identity (see the module's docstring); called as grants are made."""
        self.labels[identity_hash] = label

    def take(self, event: dict[str, object]) -> None:
        if event.get("ev") != "access":
            return
        try:
            entry = AccessRecord.model_validate(event)
        except ValidationError:
            log.debug("egress: a record that is not one was dropped")
            return
        identity = entry.identity or "-"
        label = self.labels.get(identity, "other")
        metrics.egress_request(label, entry.pattern, entry.decision, entry.up, entry.down, self.patterns)
        self._count(identity, entry.up + entry.down)
        if entry.grant is not None:
            self._summarise(entry.grant, entry)
        log.info(
            "egress %s %s %s status=%s up=%d down=%d identity=%s session=%s%s",
            entry.decision,
            entry.method,
            entry.host,
            entry.status if entry.status is not None else "-",
            entry.up,
            entry.down,
            identity,
            entry.session or "-",
            f" reason={entry.reason!r}" if entry.reason else "",
            extra={
                "fields": {
                    "egress": entry.decision,
                    "method": entry.method,
                    "host": entry.host,
                    "status": entry.status,
                    "bytes_up": entry.up,
                    "bytes_down": entry.down,
                    "identity": identity,
                    "session": entry.session,
                    "pattern": entry.pattern,
                }
            },
        )

    def _count(self, identity: str, nbytes: int) -> None:
        today = time.strftime("%Y-%m-%d", time.gmtime())
        if today != self.day:
            self.day, self.used = today, {}
        if nbytes:
            self.used[identity] = self.used.get(identity, 0) + nbytes
            self.dirty = True

    def _summarise(self, grant: str, entry: AccessRecord) -> None:
        summary = self.summaries.get(grant)
        if summary is None:
            summary = self.summaries[grant] = Summary()
            while len(self.summaries) > GRANTS_KEPT:
                self.summaries.popitem(last=False)
        summary.requests += 1
        summary.bytes += entry.up + entry.down
        if entry.decision == "refused":
            summary.refused += 1
            summary.first_refusal = summary.first_refusal or entry.reason
        elif entry.decision == "cut" and summary.cut is None:
            summary.cut = entry.reason

    def notes(self, grant: str) -> list[str]:
        """What a run's result says of its egress (refusals, a cut), once; empty when all went through."""
        summary = self.summaries.pop(grant, None)
        self.ended_bytes[grant] = 0 if summary is None else summary.bytes  # for its run's usage
        while len(self.ended_bytes) > GRANTS_KEPT:
            self.ended_bytes.popitem(last=False)
        if summary is None:
            return []
        notes = []
        if summary.refused:
            notes.append(f"egress: {summary.refused} of {summary.requests} requests refused ({summary.first_refusal})")
        if summary.cut:
            notes.append(f"egress: a connection was cut: {summary.cut}")
        return notes

    def bytes_of(self, grant: str) -> int | None:
        """The bytes up and down the proxy recorded for a run of ``grant`` since its notes were last
        taken (at the run's end), once; None when they were not taken."""
        return self.ended_bytes.pop(grant, None)

    def usage_message(self) -> dict[str, object]:
        return {"op": "usage", "day": self.day or time.strftime("%Y-%m-%d", time.gmtime()), "used": dict(self.used)}

    # -- the day's counters on disk ------------------------------------------------------------------
    def load(self) -> None:
        """The day's counters a previous server kept (blocking; a file of the state directory)."""
        if self.state_dir is None:
            return
        try:
            data = json.loads((self.state_dir / USAGE_FILE).read_text())
            if data.get("day") == time.strftime("%Y-%m-%d", time.gmtime()):
                self.day = str(data["day"])
                self.used = {str(k): int(v) for k, v in dict(data["used"]).items()}
        except (OSError, ValueError, KeyError, TypeError, AttributeError):
            return

    def save(self) -> None:
        """Write the day's counters if they changed (blocking; atomic replace, mode 0600)."""
        if self.state_dir is None or not self.dirty:
            return
        self.dirty = False
        path = self.state_dir / USAGE_FILE
        try:
            fd = os.open(f"{path}.tmp", os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
            with os.fdopen(fd, "w") as handle:
                json.dump({"day": self.day, "used": self.used}, handle)
            os.replace(f"{path}.tmp", path)
        except OSError as exc:
            log.warning("egress: could not keep the day's counters in %s: %s", path, exc)
