"""What the audit log says each identity spent: its ``run`` lines added up over a time range.

Read for ``mcp-code-exec usage``, so an operator can answer "what did we spend last week" from the
log alone. Only sealed lines count (a damaged one is skipped; ``audit verify`` says where).
"""

from __future__ import annotations

import csv
import datetime
import io
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path

from pydantic import ValidationError

from ..config.units import MIB
from ..models import Usage, UsageTotals
from .chain import lines_of, rotated_from, unseal

RELATIVE = re.compile(r"^(\d+)([smhdw])$")
UNITS = {"s": 1, "m": 60, "h": 3600, "d": 86400, "w": 7 * 86400}
COLUMNS = ("identity", "runs", "refused", "wall_s", "cpu_user_s", "cpu_system_s", "idle_cpu_s", "peak_memory_mb",
           "data_written_mb", "packages", "tool_calls", "egress_mb")  # fmt: skip


def parse_time(text: str, now: float) -> float:
    """An ISO date or time (UTC unless it says), or a span back from now: ``90m``, ``24h``, ``7d``, ``2w``."""
    relative = RELATIVE.match(text.strip())
    if relative:
        return now - int(relative.group(1)) * UNITS[relative.group(2)]
    try:
        moment = datetime.datetime.fromisoformat(text.strip().replace("Z", "+00:00"))
    except ValueError:
        raise ValueError(f"{text!r} is not a time: give an ISO date or time, or a span like 24h or 7d") from None
    if moment.tzinfo is None:
        moment = moment.replace(tzinfo=datetime.UTC)
    return moment.timestamp()


def log_files(path: Path) -> list[Path]:
    """The audit log and the files rotated from it."""
    return rotated_from(path) + ([path] if path.exists() else [])


@dataclass
class Spent:
    totals: UsageTotals = field(default_factory=UsageTotals)
    refused: int = 0


def spent(paths: Iterable[Path], since: float | None = None, until: float | None = None) -> dict[str, Spent]:
    """Per identity (as the log names it): its runs' usage, and its calls a quota refused."""
    found: dict[str, Spent] = {}
    for _, _, line in lines_of(paths):
        sealed = unseal(line)
        if sealed is None:
            continue
        body = sealed[2]
        try:
            at = datetime.datetime.fromisoformat(str(body.get("time", "")).replace("Z", "+00:00")).timestamp()
        except ValueError:
            continue
        if (since is not None and at < since) or (until is not None and at >= until):
            continue
        who = str(body.get("identity", "-"))
        if body.get("event") == "run" and isinstance(body.get("usage"), dict):
            try:
                usage = Usage.model_validate(body["usage"])
            except ValidationError:
                continue
            found.setdefault(who, Spent()).totals.add(usage)
        elif body.get("event") == "idle_cpu" and isinstance(body.get("cpu_s"), int | float):
            totals = found.setdefault(who, Spent()).totals
            totals.idle_cpu_s = round(totals.idle_cpu_s + max(0.0, float(body["cpu_s"])), 3)
        elif body.get("event") == "call" and str(body.get("outcome", "")).startswith("refused: quota"):
            found.setdefault(who, Spent()).refused += 1
    return found


def cpu_of(totals: UsageTotals) -> float:
    return totals.cpu_user_s + totals.cpu_system_s + totals.idle_cpu_s


def rows(found: Mapping[str, Spent], names: Mapping[str, str]) -> list[list[str]]:
    """One row per identity (most CPU first), ``names`` turning hashes into the names they are of."""
    out = []
    for who, each in sorted(found.items(), key=lambda item: -cpu_of(item[1].totals)):
        t = each.totals
        out.append([
            names.get(who, who), str(t.runs), str(each.refused), f"{t.wall_s:.1f}", f"{t.cpu_user_s:.1f}",
            f"{t.cpu_system_s:.1f}", f"{t.idle_cpu_s:.1f}", f"{t.peak_memory_bytes / MIB:.1f}",
            f"{t.data_written_bytes / MIB:.1f}",
            str(t.packages_installed), str(t.tool_calls), f"{t.egress_bytes / MIB:.1f}",
        ])  # fmt: skip
    return out


def render(table: list[list[str]], as_csv: bool) -> str:
    if as_csv:
        buffer = io.StringIO()
        writer = csv.writer(buffer, lineterminator="\n")
        writer.writerow(COLUMNS)
        writer.writerows(table)
        return buffer.getvalue()
    widths = [max(len(str(row[i])) for row in [list(COLUMNS), *table]) for i in range(len(COLUMNS))]
    lines = []
    for row in [list(COLUMNS), *table]:
        cells = [
            cell.ljust(w) if i == 0 else cell.rjust(w) for i, (cell, w) in enumerate(zip(row, widths, strict=True))
        ]
        lines.append("  ".join(cells).rstrip())
    return "\n".join(lines) + "\n"
