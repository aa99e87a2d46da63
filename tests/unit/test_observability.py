"""Metrics, spans and log lines over the in-memory engine: what they carry, and what they never do."""

from __future__ import annotations

import json
import logging
import re
import shutil
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import anyio
import httpx2
import pytest
from _fake_agent import FakeAgent
from mcp import Client
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from starlette.applications import Starlette
from starlette.routing import Route
from test_service_in_memory import running, settings

from mcp_code_exec.config.faces import MetricsSettings
from mcp_code_exec.errors import ConfigError
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.mcp_server.http.auth import StaticTokens, auth_arguments
from mcp_code_exec.mcp_server.http.listeners import connection_budget, is_loopback
from mcp_code_exec.mcp_server.http.observe import MetricsAccess, check_metrics_port, counting_refusals, metrics_port
from mcp_code_exec.observability import metrics
from mcp_code_exec.observability.logs import JsonFormatter
from mcp_code_exec.observability.tracing import span

pytestmark = pytest.mark.anyio
CALLER_TRACE = "4bf92f3577b34da6a3ce929d0e0e4736"
CALLER_SPAN = "00f067aa0ba902b7"
SECRET_CODE = "print('the secret 7f3a9c')"
TOKENS = {"ops": "ops-token-0123456789", "alice": "alice-token-0123456789"}


@pytest.fixture(scope="module")
def spans() -> Iterator[InMemorySpanExporter]:
    """The SDK's in-memory exporter behind the process's tracer provider (set once per process)."""
    exporter = InMemorySpanExporter()
    provider = trace.get_tracer_provider()
    if not isinstance(provider, TracerProvider):
        provider = TracerProvider()
        trace.set_tracer_provider(provider)
    provider.add_span_processor(SimpleSpanProcessor(exporter))
    yield exporter
    exporter.clear()


def series_of_ids() -> set[tuple[str, tuple[tuple[str, str], ...]]]:
    """Exported series whose label values look like a session, run, client id or a path."""
    return {
        series
        for series in metrics.label_values()
        if any(value.startswith(("s_", "r_", "token:", "/", "who-")) for _, value in series[1])
    }


async def test_a_thousand_runs_over_a_hundred_sessions_and_ten_identities_add_no_series() -> None:
    config = settings(pool={"size": 2}, sessions={"max_sessions": 100, "max_per_client": 10})
    async with running(FakeAgent(), config) as (service, _):
        warm_up = await service.new_session("who-warm-up")
        await service.run("who-warm-up", "1", session_id=warm_up.session_id)
        await service.run("who-warm-up", "1")
        await service.close_session("who-warm-up", warm_up.session_id)
        before = metrics.label_values()
        ran = metrics.RUNS_FINISHED.labels(kind="session", status="ok")._value.get()
        sessions = [(f"who-{n % 10}", (await service.new_session(f"who-{n % 10}")).session_id) for n in range(100)]
        for round_ in range(9):
            for owner, session_id in sessions:
                assert (await service.run(owner, str(round_), session_id=session_id)).status == "ok"
        for owner, _ in sessions:
            assert (await service.run(owner, "stateless")).status == "ok"
        for owner, session_id in sessions:
            await service.close_session(owner, session_id)
        assert metrics.RUNS_FINISHED.labels(kind="session", status="ok")._value.get() == ran + 900
        assert metrics.label_values() - before == set()
        assert series_of_ids() == set()


async def test_run_python_with_a_traceparent_makes_spans_under_the_callers_trace_without_user_data(
    spans: InMemorySpanExporter,
) -> None:
    spans.clear()
    async with running(FakeAgent(), settings()) as (service, _), Client(build_server(service)) as client:
        meta = {"traceparent": f"00-{CALLER_TRACE}-{CALLER_SPAN}-01"}
        answer = await client.call_tool("run_python", {"code": SECRET_CODE}, meta=meta)  # type: ignore[arg-type]
        assert answer.structured_content is not None and "7f3a9c" in answer.structured_content["stdout"]
    finished = {s.name: s for s in spans.get_finished_spans()}
    ours = ["mcpx.admission", "mcpx.container.acquire", "mcpx.sandbox.run", "mcpx.result.delivery"]
    assert set(ours) <= set(finished), sorted(finished)
    by_id = {s.context.span_id: s for s in spans.get_finished_spans() if s.context is not None}
    for name in ours:
        assert f"{finished[name].context.trace_id:032x}" == CALLER_TRACE
        assert int(CALLER_SPAN, 16) in ancestors(finished[name], by_id), name
    for each in spans.get_finished_spans():
        for value in (each.attributes or {}).values():
            assert "7f3a9c" not in str(value) and "/mnt/data" not in str(value), (each.name, value)


def ancestors(child: ReadableSpan, by_id: dict[int, ReadableSpan]) -> list[int]:
    found = []
    parent = child.parent
    while parent is not None:
        found.append(parent.span_id)
        above = by_id.get(parent.span_id)
        parent = above.parent if above is not None else None
    return found


async def test_metrics_refuse_a_missing_an_unknown_and_an_unlisted_token_and_serve_a_listed_one() -> None:
    access = MetricsAccess(MetricsSettings(readers=["ops"]), StaticTokens(TOKENS))
    app = Starlette(routes=[Route("/metrics", access.endpoint)])
    refused_before = metrics.REJECTED.labels(reason="auth_refused")._value.get()
    async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
        assert (await http.get("/metrics")).status_code == 401
        assert (await http.get("/metrics", headers={"Authorization": "Bearer nope"})).status_code == 401
        assert (await http.get("/metrics", headers=bearer("alice"))).status_code == 403
        listed = await http.get("/metrics", headers=bearer("ops"))
    assert listed.status_code == 200 and "mcpx_runs_started_total" in listed.text
    assert metrics.REJECTED.labels(reason="auth_refused")._value.get() == refused_before + 3
    public = MetricsAccess(MetricsSettings(public=True), StaticTokens(TOKENS))
    assert await public.refusal(None) is None


def bearer(name: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {TOKENS[name]}"}


async def test_a_refused_token_on_the_mcp_endpoint_is_counted_and_logged_without_the_token(
    caplog: pytest.LogCaptureFixture,
) -> None:
    async with running(FakeAgent(), settings()) as (service, _):
        server = build_server(service, auth=auth_arguments(TOKENS))
        app = counting_refusals(server.streamable_http_app(host="127.0.0.1"))
        before = metrics.REJECTED.labels(reason="auth_refused")._value.get()
        async with httpx2.AsyncClient(transport=httpx2.ASGITransport(app=app), base_url="http://127.0.0.1") as http:
            with caplog.at_level(logging.WARNING):
                refused = await http.post("/mcp", json={}, headers={"Authorization": "Bearer wrong-secret-4455"})
    assert refused.status_code == 401
    assert metrics.REJECTED.labels(reason="auth_refused")._value.get() == before + 1
    lines = [record.getMessage() for record in caplog.records if "auth refused" in record.getMessage()]
    assert lines == ["auth refused: 401 on POST /mcp"]


async def test_the_metrics_port_binds_loopback_by_default_and_refuses_another_address_unless_public() -> None:
    async with metrics_port(MetricsSettings(), 0) as bound:
        assert bound is not None and bound[0] == "127.0.0.1"
        assert await anyio.to_thread.run_sync(answers_metrics, bound[1])
    with pytest.raises(ConfigError, match="without a token"):
        check_metrics_port(MetricsSettings(host="0.0.0.0"), 9464, is_loopback)
    check_metrics_port(MetricsSettings(host="0.0.0.0", public=True), 9464, is_loopback)


def answers_metrics(port: int) -> bool:
    try:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as response:
            return b"mcpx_build_info" in response.read()
    except OSError:
        return False


async def test_json_log_lines_carry_the_trace_id_of_the_call(spans: InMemorySpanExporter) -> None:
    record = logging.LogRecord("mcp_code_exec.x", logging.WARNING, __file__, 1, "auth refused: %d", (401,), None)
    outside = json.loads(JsonFormatter().format(record))
    assert set(outside) == {"time", "level", "logger", "message"} and outside["message"] == "auth refused: 401"
    with span("mcpx.test"):
        inside = json.loads(JsonFormatter().format(record))
        expected = f"{trace.get_current_span().get_span_context().trace_id:032x}"
    assert inside["trace_id"] == expected and inside["level"] == "warning"


@pytest.mark.skipif(shutil.which("promtool") is None, reason="promtool (Debian's prometheus package) is not installed")
async def test_promtool_accepts_the_exposition() -> None:
    async with running(FakeAgent(), settings()) as (service, _):
        session = await service.new_session("me")
        await service.run("me", "1", session_id=session.session_id)
        await service.run("me", "1")
        text = metrics.exposition()
    with anyio.fail_after(30):
        checked = await anyio.run_process(["promtool", "check", "metrics"], input=text, check=False)
    assert checked.returncode == 0, checked.stdout.decode() + checked.stderr.decode()


def test_a_label_value_outside_its_set_is_recorded_as_other() -> None:
    metrics.rejected("s_0123456789abcdef")
    metrics.run_started("r_0123456789abcdef")
    assert series_of_ids() == set()
    assert metrics.REJECTED.labels(reason="other")._value.get() >= 1


def test_the_docs_page_lists_every_metric_and_the_dashboard_uses_only_existing_ones() -> None:
    docs = Path(__file__).resolve().parents[2] / "docs"
    exported = {family.name for family in metrics.REGISTRY.collect() if family.name.startswith("mcpx_")}
    exported = {name + "_total" if name + "_total" in metrics.exposition().decode() else name for name in exported}
    page = (docs / "observability.md").read_text()
    assert {name for name in exported if f"`{name}`" not in page} == set()
    used = set(re.findall(r"mcpx_[a-z_]+", (docs / "grafana-dashboard.json").read_text()))
    known = exported | {f"{name}_{part}" for name in exported for part in ("bucket", "count", "sum")}
    assert used - known == set()


def test_without_a_tracer_provider_a_step_adds_no_span(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(trace, "get_tracer_provider", trace.ProxyTracerProvider)  # as before anything is installed
    outside = trace.get_current_span()
    with span("mcpx.step", kind="session"):
        assert trace.get_current_span() is outside


def test_the_listeners_connections_leave_half_the_descriptors_and_at_least_the_reserve() -> None:
    assert connection_budget(2000, 64, limit=1_048_576).total == 2064  # the caps, where descriptors abound
    assert connection_budget(2000, 64, limit=1024).total == 512  # half of a small limit
    assert connection_budget(2000, limit=400).total == 144  # the reserve, where half is less
    assert connection_budget(2000, limit=256).total == 16  # some connections still, the rest reserved
    budget = connection_budget(64, limit=1024)
    assert [budget.take() for _ in range(65)].count(True) == 64
    budget.give_back()
    assert budget.take() and not budget.take()
    assert budget.backlog(64) == 16 and connection_budget(2000, limit=1024).backlog(2000) == 64
