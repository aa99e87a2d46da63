"""The server's Prometheus metrics, on a registry of their own, and one recording function each.

Labels take values from closed sets only (kinds, statuses, reasons) or from the configuration
(engine names, code-mode server names): a value outside its set is recorded as ``other``, so no
caller can grow a series per session, run, client or path. Gauges of live state (pools, sessions,
engines) are read when scraped from what ``watch`` was given, so they always agree with /healthz.
"""

from __future__ import annotations

import time
import weakref
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, Protocol

import prometheus_client
from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.core import GaugeMetricFamily, Metric
from prometheus_client.registry import Collector

from .. import __version__

# No *_created series: they would double every counter's output.
prometheus_client.disable_created_metrics()  # type: ignore[no-untyped-call]

REGISTRY = CollectorRegistry()
prometheus_client.ProcessCollector(registry=REGISTRY)
prometheus_client.PlatformCollector(registry=REGISTRY)
prometheus_client.GCCollector(registry=REGISTRY)
CONTENT_TYPE = prometheus_client.CONTENT_TYPE_LATEST

# From a millisecond (a warm hit) to an hour (max_run_s): the library's default buckets start at 5 ms
# and stop at 10 s, which loses both the fast end and long runs.
SECONDS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 300, 900, 3600)

KINDS = ("stateless", "session")
POOLS = ("stateless", "sessions")
STATUSES = ("ok", "error", "timeout", "memory_limit", "crashed", "cancelled")
ADMISSIONS = ("warm", "waited", "cold")
REPLACEMENTS = ("recycled", "broken", "crashed", "memory", "moved", "surplus")
REJECTIONS = (
    "client_limit",
    "pool_busy",
    "code_too_large",
    "session_busy",
    "session_limit",
    "auth_refused",
    "audit_unavailable",
)
QUOTAS = ("runs_per_minute", "cpu_s_per_hour", "cpu_s_per_day", "package_installs_per_day", "stored_mb")
DIRECTIONS = ("in", "out")
WAYS = ("tool", "url")
RESULTS = ("ok", "refused", "timeout", "failed")
DECISIONS = ("allow", "deny", "ask_accepted", "ask_declined", "ask_timeout")
EGRESS_DECISIONS = ("allowed", "refused", "cut", "error")
EGRESS_DIRECTIONS = ("up", "down")
OTHER = "other"


def _one_of(value: str, allowed: Sequence[str]) -> str:
    return value if value in allowed else OTHER


def _counter(name: str, doc: str, labels: Sequence[str] = ()) -> Counter:
    return Counter(name, doc, labels, registry=REGISTRY)


def _histogram(name: str, doc: str, labels: Sequence[str] = ()) -> Histogram:
    return Histogram(name, doc, labels, buckets=SECONDS, registry=REGISTRY)


RUNS_STARTED = _counter("mcpx_runs_started_total", "Runs admitted and started, by kind.", ["kind"])
RUNS_FINISHED = _counter("mcpx_runs_finished_total", "Runs ended, by kind and status.", ["kind", "status"])
RUN_DURATION = _histogram("mcpx_run_duration_seconds", "From admission to the end of a run, by kind.", ["kind"])
ADMISSION_WAIT = _histogram(
    "mcpx_admission_wait_seconds",
    "Time a caller waited for a pool's container: warm (one was idle), waited (one came back), cold (one was started).",
    ["pool", "how"],
)
CONTAINER_STARTS = _counter("mcpx_container_starts_total", "Container starts by a pool, by result.", ["pool", "result"])
CONTAINER_START_DURATION = _histogram(
    "mcpx_container_start_duration_seconds", "Time to start a container until its agent answers.", ["pool"]
)
REPLACEMENTS_TOTAL = _counter(
    "mcpx_container_replacements_total", "Containers a pool destroyed and replaced, by reason.", ["pool", "reason"]
)
REJECTED = _counter("mcpx_rejections_total", "Calls refused before any code ran, by reason.", ["reason"])
SESSIONS_CREATED = _counter("mcpx_sessions_created_total", "Sessions created.")
SESSIONS_CLOSED = _counter("mcpx_sessions_closed_total", "Sessions ended, for any reason (expired ones included).")
SESSIONS_EXPIRED = _counter("mcpx_sessions_expired_total", "Sessions ended by the idle timeout or the lifetime cap.")
SESSIONS_RESTARTED = _counter(
    "mcpx_sessions_restarted_total", "Session containers replaced after theirs died (the variables are lost)."
)
SNAPSHOTS = _counter(
    "mcpx_session_snapshots_total",
    "Session snapshots waited for (by a pause, a fork or a stop): ok when complete, else failed.",
    ["result"],
)
SNAPSHOT_DURATION = _histogram(
    "mcpx_session_snapshot_duration_seconds", "Time a pause, fork or stop waited for a session's snapshot."
)
RESTORES = _counter("mcpx_session_restores_total", "Sessions restored from a snapshot, by result.", ["result"])
RESTORE_DURATION = _histogram("mcpx_session_restore_duration_seconds", "Time to restore a session.")
FILE_BYTES = _counter(
    "mcpx_file_bytes_total",
    "Bytes of files moved: in (to a sandbox) or out, through the file tools or file URLs.",
    ["direction", "way"],
)
PACKAGE_INSTALLS = _counter(
    "mcpx_package_installs_total", "Cells' package installs (those that install anything), by result.", ["result"]
)
PACKAGE_INSTALL_DURATION = _histogram(
    "mcpx_package_install_duration_seconds", "Time to resolve, fetch and copy in a cell's packages."
)
TOOL_CALLS = _counter(
    "mcpx_code_mode_calls_total", "Code-mode calls to MCP servers, by server and decision.", ["server", "decision"]
)
QUOTA_REFUSALS = _counter(
    "mcpx_quota_refusals_total", "Calls refused because an identity's quota was used up, by quota.", ["quota"]
)
AUDIT_LINES = _counter("mcpx_audit_lines_total", "Lines written to the audit log.")
AUDIT_FAILURES = _counter("mcpx_audit_write_failures_total", "Audit lines that could not be written.")
AUDIT_WRITABLE = Gauge(
    "mcpx_audit_writable",
    "1 while the audit log is written (or none is configured), 0 while it cannot be.",
    registry=REGISTRY,
)
AUDIT_WRITABLE.set(1)
EGRESS_REQUESTS = _counter(
    "mcpx_egress_requests_total",
    "Requests and tunnels through the egress proxy, by identity (hash, local or other), allow entry and decision.",
    ["identity", "pattern", "decision"],
)
EGRESS_BYTES = _counter(
    "mcpx_egress_bytes_total",
    "Bytes through the egress proxy, by identity, allow entry and direction (up: from the sandbox).",
    ["identity", "pattern", "direction"],
)
EGRESS_PROXY_STARTS = _counter("mcpx_egress_proxy_starts_total", "Starts of the egress proxy (restarts included).")
BUILD_INFO = Gauge("mcpx_build_info", "Always 1; the server's version as a label.", ["version"], registry=REGISTRY)
BUILD_INFO.labels(version=__version__).set(1)


# -- recording: one call at each call site ----------------------------------------------------------
def run_started(kind: str) -> None:
    RUNS_STARTED.labels(kind=_one_of(kind, KINDS)).inc()


def run_finished(kind: str, status: str, started: float) -> None:
    """``started``: the run's ``time.monotonic()`` at admission."""
    kind = _one_of(kind, KINDS)
    RUNS_FINISHED.labels(kind=kind, status=_one_of(status, STATUSES)).inc()
    RUN_DURATION.labels(kind=kind).observe(max(0.0, time.monotonic() - started))


def admitted(pool: str, how: str, waited_s: float) -> None:
    ADMISSION_WAIT.labels(pool=_one_of(pool, POOLS), how=_one_of(how, ADMISSIONS)).observe(waited_s)


def container_started(pool: str, ok: bool, took_s: float) -> None:
    pool = _one_of(pool, POOLS)
    CONTAINER_STARTS.labels(pool=pool, result="ok" if ok else "failed").inc()
    if ok:
        CONTAINER_START_DURATION.labels(pool=pool).observe(took_s)


def container_replaced(pool: str, reason: str) -> None:
    REPLACEMENTS_TOTAL.labels(pool=_one_of(pool, POOLS), reason=_one_of(reason, REPLACEMENTS)).inc()


def rejected(reason: str) -> None:
    REJECTED.labels(reason=_one_of(reason, REJECTIONS)).inc()


def session_created() -> None:
    SESSIONS_CREATED.inc()


def session_closed() -> None:
    SESSIONS_CLOSED.inc()


def session_expired() -> None:
    SESSIONS_EXPIRED.inc()


def session_restarted() -> None:
    SESSIONS_RESTARTED.inc()


def snapshot_synced(ok: bool, took_s: float) -> None:
    SNAPSHOTS.labels(result="ok" if ok else "failed").inc()
    SNAPSHOT_DURATION.observe(took_s)


def session_restored(ok: bool, took_s: float) -> None:
    RESTORES.labels(result="ok" if ok else "failed").inc()
    RESTORE_DURATION.observe(took_s)


def file_bytes(direction: str, way: str, count: int) -> None:
    FILE_BYTES.labels(direction=_one_of(direction, DIRECTIONS), way=_one_of(way, WAYS)).inc(max(0, count))


def packages_installed(result: str, took_s: float) -> None:
    PACKAGE_INSTALLS.labels(result=_one_of(result, RESULTS)).inc()
    PACKAGE_INSTALL_DURATION.observe(took_s)


def code_mode_call(server: str, decision: str, known_servers: Iterable[str]) -> None:
    """``server``: a name from the configuration (``known_servers``), so the set is bounded."""
    TOOL_CALLS.labels(server=_one_of(server, tuple(known_servers)), decision=_one_of(decision, DECISIONS)).inc()


def quota_refused(quota: str) -> None:
    QUOTA_REFUSALS.labels(quota=_one_of(quota, QUOTAS)).inc()


def audit_written(ok: bool) -> None:
    """One audit line written (``ok``) or lost; the gauge follows the last attempt."""
    (AUDIT_LINES if ok else AUDIT_FAILURES).inc()
    AUDIT_WRITABLE.set(1 if ok else 0)


def egress_request(
    identity: str, pattern: str | None, decision: str, up: int, down: int, patterns: Iterable[str]
) -> None:
    """``identity``: a label the caller bounded (see ``egress.accounting``); ``pattern``: an entry
    of the configuration (``patterns``), or none for a request no entry allowed."""
    labels = {"identity": identity, "pattern": _one_of(pattern or "", tuple(patterns)) if pattern else "none"}
    EGRESS_REQUESTS.labels(decision=_one_of(decision, EGRESS_DECISIONS), **labels).inc()
    if up:
        EGRESS_BYTES.labels(direction="up", **labels).inc(max(0, up))
    if down:
        EGRESS_BYTES.labels(direction="down", **labels).inc(max(0, down))


def egress_proxy_started() -> None:
    EGRESS_PROXY_STARTS.inc()


# -- live state, read at scrape time -------------------------------------------------------------
class PoolState(Protocol):
    name: str
    max_size: int

    @property
    def idle(self) -> int: ...
    @property
    def busy(self) -> int: ...
    @property
    def owned(self) -> int: ...


class Watched:
    """What a running service shows at scrape time: its pools, open sessions and engines.

    Held weakly: a service that ended (tests run several in one process) drops out by itself.
    """

    def __init__(
        self,
        pools: Sequence[PoolState],
        open_sessions: Callable[[], int],
        engines: Callable[[], list[dict[str, Any]]],
        paused_sessions: Callable[[], int] = lambda: 0,
    ) -> None:
        self.pools = list(pools)
        self.open_sessions = open_sessions
        self.engines = engines
        self.paused_sessions = paused_sessions


class LiveState(Collector):
    def __init__(self) -> None:
        self._watched: weakref.WeakSet[Watched] = weakref.WeakSet()

    def add(self, watched: Watched) -> None:
        self._watched.add(watched)

    def describe(self) -> Iterable[Metric]:
        return []  # read at collect time only: what is watched comes and goes

    def collect(self) -> Iterator[Metric]:
        containers = GaugeMetricFamily(
            "mcpx_pool_containers",
            "A pool's containers: warm (idle), busy (lent or being cleaned), starting.",
            labels=["pool", "state"],
        )
        max_size = GaugeMetricFamily("mcpx_pool_max_containers", "A pool's largest size.", labels=["pool"])
        sessions = GaugeMetricFamily("mcpx_sessions_open", "Sessions open now.")
        paused = GaugeMetricFamily("mcpx_sessions_paused", "Sessions paused (no container; state saved).")
        up = GaugeMetricFamily("mcpx_engine_up", "1 while an engine answers, else 0.", labels=["engine"])
        held = GaugeMetricFamily("mcpx_engine_containers", "Containers of this server on an engine.", labels=["engine"])
        totals: dict[tuple[str, str], int] = {}
        sizes: dict[str, int] = {}
        open_total = paused_total = 0
        engines: dict[str, tuple[bool, int]] = {}
        for watched in list(self._watched):
            for pool in watched.pools:
                name = _one_of(pool.name, POOLS)
                starting = max(0, pool.owned - pool.idle - pool.busy)
                for state, value in (("warm", pool.idle), ("busy", pool.busy), ("starting", starting)):
                    totals[name, state] = totals.get((name, state), 0) + value
                sizes[name] = sizes.get(name, 0) + pool.max_size
            open_total += watched.open_sessions()
            paused_total += watched.paused_sessions()
            for engine in watched.engines():
                was_up, count = engines.get(engine["name"], (False, 0))
                engines[engine["name"]] = (was_up or bool(engine["up"]), count + int(engine["containers"]))
        for (pool_name, state), value in sorted(totals.items()):
            containers.add_metric([pool_name, state], value)
        for pool_name, value in sorted(sizes.items()):
            max_size.add_metric([pool_name], value)
        sessions.add_metric([], open_total)
        paused.add_metric([], paused_total)
        for name, (is_up, count) in sorted(engines.items()):
            up.add_metric([name], 1 if is_up else 0)
            held.add_metric([name], count)
        yield from (containers, max_size, sessions, paused, up, held)


LIVE = LiveState()
REGISTRY.register(LIVE)


def watch(watched: Watched) -> Watched:
    """Show a service's live state until the returned object (keep it) is garbage."""
    LIVE.add(watched)
    return watched


def exposition() -> bytes:
    """The text a scrape gets (Prometheus text format)."""
    return prometheus_client.generate_latest(REGISTRY)


def label_values() -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Every (metric, labels) series now exported: what a cardinality check compares."""
    return {
        (sample.name, tuple(sorted(sample.labels.items())))
        for family in REGISTRY.collect()
        for sample in family.samples
        if not sample.name.startswith(("process_", "python_"))
    }
