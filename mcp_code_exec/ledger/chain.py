"""The audit log's chain: how a line is sealed, and how a file of them is checked.

A line is a JSON object on one line (ASCII only) whose last member is ``hash``: the SHA-256 (with
a key, the HMAC-SHA256) of everything before ``,"hash":``; that text holds ``prev``, the hash of the
line before, and ``seq``, one more than its. Changing a byte of a line changes its hash; making
its hash again breaks the next line's ``prev``; removing or moving lines breaks ``prev`` and
``seq``. Each file begins with an ``audit.file`` line chained to the last line of the file before,
so the chain runs on across rotations, and a file whose first line is anything else was cut at its
start. Only the holder of the key can make a chain that verifies
with the key; without one, anyone who can write the file can make the whole rest of it again, and
a copy kept elsewhere (a log pipeline) is what shows it.
"""

from __future__ import annotations

import datetime
import hashlib
import hmac
import json
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

ZERO = "0" * 64
HASH_MARK = ',"hash":"'
SEALED_TAIL = len(HASH_MARK) + 64 + 2  # ,"hash":"<64 hex>"}
FILE_EVENT = "audit.file"
DAMAGED_EVENT = "audit.damaged"  # a server went on after lines at the file's end that were not sealed lines
REPLACED_EVENT = "audit.replaced"  # the file a server wrote was removed or replaced under it
TRUNCATED_EVENT = "audit.truncated"  # at a start: the file ends before the last line a server kept as written
MAX_BREAKS = 20
TAIL_READ = 1 << 16
KEY_VARIABLE = "MCP_CODE_EXEC_AUDIT_KEY"


def iso(at: float) -> str:
    """A line's time: UTC, to the millisecond."""
    return datetime.datetime.fromtimestamp(at, datetime.UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def digest(prefix: bytes, key: bytes | None) -> str:
    return hmac.new(key, prefix, hashlib.sha256).hexdigest() if key else hashlib.sha256(prefix).hexdigest()


def seal(body: dict[str, Any], key: bytes | None) -> tuple[bytes, str]:
    """The line for ``body`` (with its newline) and its hash."""
    text = json.dumps(body, ensure_ascii=True, separators=(",", ":"), default=str)
    prefix = text[:-1].encode("ascii")
    sealed = digest(prefix, key)
    return prefix + f'{HASH_MARK}{sealed}"}}\n'.encode("ascii"), sealed


def unseal(line: bytes) -> tuple[bytes, str, dict[str, Any]] | None:
    """(the sealed prefix, the hash it carries, the object) of a line; None when it is not one."""
    line = line.rstrip(b"\n")
    if len(line) <= SEALED_TAIL or not line.endswith(b'"}'):
        return None
    prefix, tail = line[:-SEALED_TAIL], line[-SEALED_TAIL:].decode("ascii", "replace")
    carried = tail[len(HASH_MARK) : -2]
    if not tail.startswith(HASH_MARK) or len(carried) != 64 or any(c not in "0123456789abcdef" for c in carried):
        return None
    try:
        body = json.loads(prefix + b"}")
    except ValueError:
        return None
    return (prefix, carried, body) if isinstance(body, dict) else None


@dataclass
class Break:
    file: str
    line: int
    what: str

    def __str__(self) -> str:
        return f"{self.file}:{self.line}: {self.what}"


@dataclass
class Verdict:
    lines: int = 0
    first_seq: int | None = None
    last_seq: int | None = None
    head: str = ZERO  # the last line's hash: an anchor to keep elsewhere
    breaks: list[Break] = field(default_factory=list)
    notes: list[str] = field(default_factory=list)

    @property
    def intact(self) -> bool:
        return not self.breaks


def first_seq(path: Path) -> int:
    """The seq a file begins at (-1 when its first line is not a sealed line), to put files in order."""
    with open(path, "rb") as handle:
        found = unseal(handle.readline(1 << 20))
    seq = found[2].get("seq") if found else None
    return seq if isinstance(seq, int) else -1


def lines_of(paths: Iterable[Path]) -> Iterator[tuple[str, int, bytes]]:
    for path in paths:
        with open(path, "rb") as handle:
            for number, line in enumerate(handle, 1):
                yield str(path), number, line


def verify(paths: list[Path], key: bytes | None) -> Verdict:
    """Check files of one chain (in the order of the seq they begin at): each line's own hash, its
    link to the line before, its seq. Every place the chain breaks is said (at most ``MAX_BREAKS``)."""
    verdict = Verdict()
    prev: str | None = None  # the hash the next line must carry; None before the first line
    seq: int | None = None
    for name, number, line in lines_of(sorted(paths, key=first_seq)):
        if len(verdict.breaks) >= MAX_BREAKS:
            verdict.notes.append(f"stopped after {MAX_BREAKS} breaks")
            break
        verdict.lines += 1
        found = unseal(line)
        if found is None:
            verdict.breaks.append(Break(name, number, "not a sealed audit line (damaged, cut short, or not ours)"))
            continue  # the next line is checked against the last sealed one: what is missing shows too
        prefix, carried, body = found
        if body.get("event") == FILE_EVENT and body.get("alg") == "hmac-sha256" and key is None:
            verdict.breaks.append(Break(name, number, f"the log is chained with a key: give it ({KEY_VARIABLE})"))
            return verdict
        problem = _link(body, prefix, carried, key, prev, seq)
        if problem is None and number == 1 and body.get("event") != FILE_EVENT:
            # Every file is begun with its ``audit.file`` line: a first line of any other kind is
            # what is left once the file's first lines were cut, which no link would show.
            cut = "lines were cut from its start"
            problem = f"seq {body.get('seq')}: the file does not begin with its {FILE_EVENT} line: {cut}"
        if problem is None and body.get("event") == REPLACED_EVENT:
            problem = (
                f"seq {body.get('seq')}: the file the server wrote was removed or replaced under it "
                f"(its lines to seq {body.get('after_seq')} are in a file set aside beside it, or gone)"
            )
        if problem is None and body.get("event") == TRUNCATED_EVENT:
            after = body.get("after_seq")
            went_on = f"the file went on from seq {after}" if after != -1 else "none of its lines were left"
            problem = (
                f"seq {body.get('seq')}: lines were cut from the end of the log before the server started "
                f"(a server had written to seq {body.get('kept_seq')}; {went_on})"
            )
        if problem is not None:
            verdict.breaks.append(Break(name, number, problem))
        elif prev is None:
            verdict.notes.append(_start(name, body))
        line_seq = body.get("seq")
        seq = line_seq if isinstance(line_seq, int) else None
        prev = carried
        verdict.first_seq = seq if verdict.first_seq is None else verdict.first_seq
        verdict.last_seq, verdict.head = seq, carried
    return verdict


def _link(
    body: dict[str, Any], prefix: bytes, carried: str, key: bytes | None, prev: str | None, seq: int | None
) -> str | None:
    """What is wrong with this line where it stands (None: nothing)."""
    if not hmac.compare_digest(digest(prefix, key), carried):
        return f"seq {body.get('seq')}: changed after it was written (its hash does not match its content)"
    if prev is None:
        return None
    line_seq = body.get("seq")
    if not isinstance(line_seq, int) or seq is None:
        return "no sequence number"
    if line_seq <= seq:
        return f"out of order: seq {line_seq} after seq {seq}"
    if line_seq > seq + 1:
        return f"seq jumps from {seq} to {line_seq}: {line_seq - seq - 1} line(s) missing before it, or moved"
    if body.get("prev") != prev:
        return (
            f"seq {line_seq}: the line before it is not the one it was chained to (that line was replaced, "
            "or edited and its hash made again)"
        )
    return None


def _start(name: str, body: dict[str, Any]) -> str:
    if body.get("event") == FILE_EVENT and body.get("prev") == ZERO:
        return f"{name} begins the chain (seq {body.get('seq')})"
    return (
        f"{name} begins at seq {body.get('seq')}, chained to a line of an earlier file not given here: "
        "give the files before it to check that link too"
    )


def sealed_by(found: tuple[bytes, str, dict[str, Any]], key: bytes | None) -> bool:
    """Whether an unsealed line's hash is the key's HMAC of it (without a key, anyone can seal a line)."""
    return key is None or hmac.compare_digest(digest(found[0], key), found[1])


def ends(
    path: Path, size: int, key: bytes | None = None
) -> tuple[dict[str, Any] | None, dict[str, Any] | None, int, bool]:
    """Where a file of ``size`` bytes ends, for the server going on with it: its last sealed line (with
    its hash as ``_hash``; None: it has none), its first line (parsed; None where it is not a sealed
    line), how many lines after the last sealed one are not sealed lines, and whether it ends in a
    line cut short (no newline). With ``key``, a line is sealed only if its HMAC is right: a forged
    last line (a seq far ahead, say) is damage, not where the chain goes on."""
    with open(path, "rb") as handle:
        found = unseal(handle.readline(1 << 20))
        first = found[2] if found else None
        reach = TAIL_READ
        while True:  # from the end, reading twice as far each time, until a sealed line is found
            start = max(0, size - reach)
            handle.seek(start)
            parts = handle.read().split(b"\n")
            cut = parts[-1] != b""
            damaged = 0
            for part in reversed(parts[1 if start else 0 : len(parts) if cut else -1]):  # [0]: maybe a line's end
                found = unseal(part)
                if found is not None and isinstance(found[2].get("seq"), int) and sealed_by(found, key):
                    return {**found[2], "_hash": found[1]}, first, damaged, cut
                damaged += 1
            if not start:
                return None, first, damaged, cut
            reach *= 2


def rotated_from(path: Path) -> list[Path]:
    """The files rotated from the log at ``path``, oldest first (named with the seq each begins at)."""
    return sorted(p for p in path.parent.glob(path.name + ".*") if p.suffix[1:].isdigit())


def prune(path: Path, keep: int) -> None:
    """The oldest files rotated from ``path`` go, past the newest ``keep`` (0: all are kept)."""
    rotated = rotated_from(path) if keep else []
    for old in rotated[: max(0, len(rotated) - keep)]:
        old.unlink(missing_ok=True)


def rotated_end(path: Path, key: bytes | None) -> tuple[int, str, int] | None:
    """Where the newest file rotated from ``path`` ends: its last sealed line's seq and hash, and the
    file's number in the chain (None: no such file, or none of its lines is sealed)."""
    rotated = rotated_from(path)
    if not rotated:
        return None
    last, first, _, _ = ends(rotated[-1], rotated[-1].stat().st_size, key)
    if last is None:
        return None
    number = first.get("file") if first is not None else None
    return int(last["seq"]), str(last["_hash"]), number if isinstance(number, int) else 0
