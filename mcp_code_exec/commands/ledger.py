"""``mcp-code-exec audit verify FILE...`` and ``mcp-code-exec usage``: the audit log, read offline.

Both print to stdout (they never serve stdio) and need no engine. ``usage`` finds the log where
the configuration says (``[audit] path``, with the files rotated from it) unless files are given,
and names the identities of the configuration (its tokens, the stdio identity) where the log holds
their hashes.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

from ..config.accounting import ENV_AUDIT_KEY


def add_parsers(commands: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    audit = commands.add_parser("audit", help="check the audit log's chain")
    actions = audit.add_subparsers(dest="audit_command", metavar="ACTION", required=True)
    verify = actions.add_parser("verify", help="check one chain of audit files; say where it breaks")
    verify.add_argument("files", nargs="+", metavar="FILE", help="the log and the files rotated from it, any order")
    usage = commands.add_parser("usage", help="per-identity totals from the audit log, over a time range")
    usage.add_argument("--config", help="configuration file (TOML): where the log is, the identities' names")
    usage.add_argument("--since", help="from: an ISO date or time (UTC), or a span back from now: 24h, 7d")
    usage.add_argument("--until", help="until (not included), as --since")
    usage.add_argument("--csv", action="store_true", help="CSV instead of a table")
    usage.add_argument("files", nargs="*", metavar="FILE", help="audit files (default: [audit] path and its rotations)")


def run(args: argparse.Namespace) -> int:
    if args.command == "audit":
        return verify(args.files)
    return usage(args)


def verify(files: list[str]) -> int:
    from ..ledger.chain import verify as check

    key = os.environ.get(ENV_AUDIT_KEY)
    try:
        verdict = check([Path(name) for name in files], key.encode() if key else None)
    except OSError as exc:
        print(f"mcp-code-exec: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    for note in verdict.notes:
        print(f"note: {note}")
    for found in verdict.breaks:
        print(f"BROKEN {found}")
    if verdict.intact:
        print(f"intact: {verdict.lines} lines, seq {verdict.first_seq} to {verdict.last_seq}; head {verdict.head}")
        return 0
    print(f"the chain breaks in {len(verdict.breaks)} place(s) of {verdict.lines} lines")
    return 1


def usage(args: argparse.Namespace) -> int:
    from ..config.settings import load_config
    from ..errors import ConfigError
    from ..ledger import report

    try:
        config = load_config(args.config)
        now = time.time()
        since = report.parse_time(args.since, now) if args.since else None
        until = report.parse_time(args.until, now) if args.until else None
    except (ConfigError, ValueError) as exc:
        print(f"mcp-code-exec: {exc}", file=sys.stderr)
        return 2
    paths = [Path(name) for name in args.files]
    if not paths:
        if config.audit.file is None:
            print("mcp-code-exec: no audit log: give its files, or the config that sets [audit] path", file=sys.stderr)
            return 2
        paths = report.log_files(config.audit.file)
    try:
        found = report.spent(paths, since, until)
    except OSError as exc:
        print(f"mcp-code-exec: {exc.filename}: {exc.strerror}", file=sys.stderr)
        return 2
    sys.stdout.write(report.render(report.rows(found, known_names(config)), args.csv))
    return 0


def known_names(config: object) -> dict[str, str]:
    """The hashes of the identities the configuration names, to the names (tokens, stdio)."""
    from ..config.settings import Config
    from ..observability.logs import identity_hash

    assert isinstance(config, Config)
    names = [f"token:{name}" for name in config.http.tokens] + ["token:default", "local"]
    names += [f"local:{config.stdio.identity}"] if config.stdio.identity else []
    names += [f"user:{os.environ.get('USER', '')}", f"user:{os.geteuid()}"]
    names += list(config.quotas.identities)
    return {identity_hash(name): name for name in names}
