"""Egress decisions without an engine: host patterns and names as the proxy compares them, grants the
server mints as the proxy reads them, reach and narrowing, addresses, budgets, and the records'
accounting. The proxy's own module (``images/egress/egress_policy.py``) is imported as the image
runs it, beside the server's ``hostpatterns``."""

from __future__ import annotations

import base64
import importlib
import logging
import sys
import time
from pathlib import Path
from typing import Any

import pytest

from mcp_code_exec.config.hostpatterns import header_host, normalise_host, parse_pattern
from mcp_code_exec.config.principals import principal_matches
from mcp_code_exec.config.settings import load_config
from mcp_code_exec.egress import reach, tokens
from mcp_code_exec.egress.accounting import Accounting
from mcp_code_exec.egress.hosts import host_entries
from mcp_code_exec.errors import ReachRefused
from mcp_code_exec.observability import metrics

IMAGE = Path(__file__).resolve().parents[2] / "images" / "egress"
KEY = b"k" * 32
CONTAINER = "c0" * 32  # a container's egress key (64 hex digits)


def proxy_policy() -> Any:
    if str(IMAGE) not in sys.path:
        sys.path.insert(0, str(IMAGE))
    return importlib.import_module("egress_policy")


def basic(token: str) -> str:
    return "Basic " + base64.b64encode(f"run:{token}".encode()).decode()


@pytest.mark.parametrize(
    ("host", "normal"),
    [
        ("DATA.Example.ORG.", "data.example.org"),
        ("[::ffff:10.0.0.1]", "10.0.0.1"),
        ("bücher.example", "xn--bcher-kva.example"),
        ("evil.example/x", None),
        ("", None),
        ("a" * 300 + ".example", None),
    ],
)
def test_names_compare_in_one_normal_form(host: str, normal: str | None) -> None:
    assert normalise_host(host) == normal


def test_a_pattern_allows_its_ports_and_an_address_only_its_own_entry() -> None:
    name, wildcard, port, literal = (
        parse_pattern(p) for p in ("a.example", "*.b.example", "c.example:8443", "10.1.2.3")
    )
    assert name.matches("a.example", 443) and name.matches("a.example", 80) and not name.matches("a.example", 8443)
    assert wildcard.matches("x.b.example", 443) and not wildcard.matches("b.example", 443)
    assert not wildcard.matches("xb.example", 443)
    assert port.matches("c.example", 8443) and not port.matches("c.example", 443)
    assert literal.matches("10.1.2.3", 443) and not name.matches("10.1.2.3", 443)
    assert header_host("A.Example:8443") == "a.example" and header_host("[::1]:80") == "::1"
    for bad in ("*", "a.*.example", "[::1", "x.example:99999", "*.10.0.0.1"):
        with pytest.raises(ValueError):
            parse_pattern(bad)


def test_principals_name_tokens_whole_identities_and_local_for_every_stdio_client() -> None:
    assert principal_matches("token:alice", ["alice"]) and principal_matches("token:alice", ["token:alice"])
    assert not principal_matches("token:bob", ["alice"])
    assert principal_matches("user:ann", ["local"]) and principal_matches("local:desk", ["local"])
    assert principal_matches("user:ann", ["user:ann"]) and not principal_matches("token:local", ["user:ann"])
    assert principal_matches("anyone", None)


def settings(**egress: Any) -> Any:
    base = {"allow": ["data.example.org", {"host": "api.example.com", "principals": ["alice"]}, "*.files.example"]}
    return load_config(environ={"TOKEN": "v"}, overrides={"egress": {**base, **egress}}).egress


def test_a_token_the_server_mints_is_a_grant_the_proxy_reads_and_an_altered_one_is_refused() -> None:
    policy = proxy_policy()
    bridge = importlib.import_module("egress_bridge")
    here = bridge.read_preamble(b"MCPX-EGRESS " + CONTAINER.encode() + b"\n")
    assert here == tokens.binding(CONTAINER)  # the proxy's bridge and the server agree
    token = tokens.mint(
        KEY, grant="r:r_1", identity="abc", session="", reach=[0, 2], expires=time.time() + 60, container=CONTAINER
    )
    grants = policy.Grants(key=KEY)
    claims = grants.claims(basic(token), time.time(), here)
    assert (claims.grant, claims.identity, claims.reach) == ("r:r_1", "abc", frozenset({0, 2}))
    body, mac = token.split(".")
    forged = tokens.b64(base64.urlsafe_b64decode(body + "==").replace(b"[0,2]", b"[0,1,2]"))
    # The MAC's first character changed (its last ones may carry no bits: "AA" can decode as they did)
    altered = f"{body}.{'B' if mac[0] == 'A' else 'A'}{mac[1:]}"
    for wrong in (f"{forged}.{mac}", altered, "plain", ""):
        with pytest.raises(policy.Refused) as refused:
            grants.claims(basic(wrong), time.time(), here)
        assert refused.value.status == 407
    with pytest.raises(policy.Refused):
        policy.Grants(key=KEY * 2).claims(basic(token), time.time(), here)
    # A grant works from its own container alone: another's key, or none, is refused
    for elsewhere in (tokens.binding("d1" * 32), None):
        with pytest.raises(policy.Refused, match="another sandbox"):
            grants.claims(basic(token), time.time(), elsewhere)
    grants.end("r:r_1", time.time() + 60)
    with pytest.raises(policy.Refused, match="ended"):
        grants.claims(basic(token), time.time(), here)


def test_the_bridge_reads_a_relays_preamble_and_nothing_else() -> None:
    proxy_policy()
    bridge = importlib.import_module("egress_bridge")
    assert bridge.read_preamble(b"MCPX-EGRESS " + CONTAINER.encode() + b"\n") == tokens.binding(CONTAINER)
    for wrong in (
        b"MCPX-EGRESS " + CONTAINER.upper().encode() + b"\n",
        b"MCPX-EGRESS " + CONTAINER.encode()[:-1] + b"\n",
        b"MCPX-EGRESS " + CONTAINER.encode(),
        b"CONNECT a.example:443 HTTP/1.1\r\n",
        b"",
    ):
        assert bridge.read_preamble(wrong) is None, wrong


def test_reach_follows_principals_and_a_narrowing_is_never_wider() -> None:
    egress = settings()
    assert reach.of_identity(egress, "token:alice") == ("data.example.org", "api.example.com", "*.files.example")
    assert reach.of_identity(egress, "token:bob") == ("data.example.org", "*.files.example")
    assert reach.narrowed(("data.example.org", "*.files.example"), ["*.files.example"]) == ("*.files.example",)
    assert reach.narrowed(("data.example.org",), []) == ()
    with pytest.raises(ReachRefused, match="can only be narrowed"):
        reach.narrowed(("data.example.org",), ["api.example.com"])
    assert reach.kept(egress, "token:alice", ("api.example.com", "gone.example")) == ("api.example.com",)
    policy = proxy_policy()
    grants = policy.Grants(key=KEY)
    config = policy.Policy.from_message({"allow": [e.host for e in egress.allow]})
    claims = policy.Claims("s:x", "i", "s", frozenset({0, 2}), time.time() + 60)
    assert grants.match(config, claims, "a.files.example", 443).text == "*.files.example"
    with pytest.raises(policy.Refused, match="not for this session"):
        grants.match(config, claims, "api.example.com", 443)
    with pytest.raises(policy.Refused, match=r"\[egress\] allow"):
        grants.match(config, claims, "evil.example", 443)
    grants.narrow("s:x", frozenset({0}))
    grants.narrow("s:x", frozenset({0, 2}))  # a second narrowing cannot give back what the first took
    with pytest.raises(policy.Refused):
        grants.match(config, claims, "a.files.example", 443)


def test_only_global_or_listed_private_addresses_are_connected_to() -> None:
    policy = proxy_policy()
    config = policy.Policy.from_message({"allow": ["a.example", "10.9.9.9:9000"], "private_ranges": ["10.20.0.0/16"]})
    name, literal = config.patterns
    assert config.choose("a.example", ["10.1.1.1", "93.184.215.14"], name) == "93.184.215.14"
    assert config.choose("a.example", ["10.20.3.4"], name) == "10.20.3.4"
    assert config.choose("10.9.9.9", [], literal) == "10.9.9.9"  # an address's own entry is its permission
    for found in (["127.0.0.1"], ["169.254.169.254"], ["10.1.1.1"], ["::1"], ["fd00::1"], ["100.64.0.1"], []):
        with pytest.raises(policy.Refused, match="private_ranges"):
            config.choose("a.example", found, name)
    assert config.intercepted() == ["(?!)"]  # never empty: an empty list would intercept every host


def test_a_secret_never_goes_in_plain_text_to_port_443() -> None:
    policy = proxy_policy()
    config = policy.Policy.from_message(
        {"allow": ["api.example"], "secrets": [{"host": "api.example", "header": "X-Key", "value": "v"}]}
    )
    assert config.secrets_for("api.example", 443, tls=True) == [("X-Key", "v")]
    assert config.secrets_for("api.example", 80, tls=False) == [("X-Key", "v")]  # plain HTTP, as configured
    assert config.secrets_for("other.example", 443, tls=False) == []
    with pytest.raises(policy.Refused, match="over TLS only"):
        config.secrets_for("api.example", 443, tls=False)


@pytest.mark.parametrize(
    "address",
    [
        "64:ff9b::a9fe:a9fe",  # NAT64 to the metadata address
        "64:ff9b::a00:5",  # NAT64 to 10.0.0.5
        "::a9fe:a9fe",  # IPv4-compatible
        "2002:a9fe:a9fe::1",  # 6to4
        "2001:0:4136:e378:8000:63bf:3fff:fdd2",  # Teredo, its client 192.0.2.45
    ],
)
def test_an_ipv6_address_carrying_a_private_ipv4_one_is_refused(address: str) -> None:
    """``is_global`` calls NAT64 and IPv4-compatible addresses global whatever IPv4 address they carry."""
    policy = proxy_policy()
    config = policy.Policy.from_message({"allow": ["a.example"], "private_ranges": ["10.20.0.0/16"]})
    with pytest.raises(policy.Refused, match="private_ranges"):
        config.choose("a.example", [address], config.patterns[0])
    assert config.choose("a.example", [address, "64:ff9b::5db8:d70e"], config.patterns[0]) == "64:ff9b::5db8:d70e"
    assert config.choose("a.example", ["64:ff9b::a14:305"], config.patterns[0]) == "64:ff9b::a14:305"  # 10.20.3.5


def test_budgets_count_a_run_and_an_identitys_day_and_say_which_setting() -> None:
    policy = proxy_policy()
    config = policy.Policy.from_message({"allow": [], "budget_run": 1000, "budget_day": 1600})
    grants = policy.Grants(key=KEY)
    now = time.time()
    run = policy.Claims("s:x", "ident", "s", frozenset(), now + 60)
    assert grants.count(config, run, 999, now) is None
    assert "budget_run_mb" in (grants.count(config, run, 1, now) or "")
    grants.new_run("s:x")  # the session's next run starts again; the day does not
    assert grants.budget_error(config, run, now) is None
    assert grants.count(config, run, 400, now) is None
    assert "budget_day_mb" in (grants.count(config, run, 200, now) or "")
    restarted = policy.Grants(key=KEY)  # a proxy started again learns the day's count from the server
    restarted.restore_day(policy.utc_day(now), {"ident": 1600})
    assert "budget_day_mb" in (restarted.budget_error(config, run, now) or "")


def test_records_become_bounded_metrics_a_log_line_and_notes_for_the_run(caplog: pytest.LogCaptureFixture) -> None:
    books = Accounting(["data.example.org"])
    books.label("abc", "local")
    before = metrics.label_values()
    caplog.set_level(logging.INFO, logger="mcp_code_exec.egress")
    for n in range(50):
        books.take({"ev": "access", "decision": "refused", "identity": f"id{n}", "grant": "r:1", "host": f"h{n}.x",
                    "method": "CONNECT", "status": 403, "reason": "not allowed", "pattern": f"made-up-{n}"})  # fmt: skip
    books.take({"ev": "access", "decision": "cut", "identity": "abc", "grant": "r:1", "host": "data.example.org",
                "pattern": "data.example.org", "up": 10, "down": 5000, "reason": "budget"})  # fmt: skip
    books.take({"ev": "access", "decision": "bogus"})
    added = {labels for _, labels in metrics.label_values() - before}
    identities = {dict(labels).get("identity") for labels in added}
    patterns = {dict(labels).get("pattern") for labels in added}
    assert identities <= {"other", "local"} and patterns <= {"none", "data.example.org", "other"}
    assert books.used["abc"] == 5010
    assert books.notes("r:1") == [
        "egress: 50 of 51 requests refused (not allowed)",
        "egress: a connection was cut: budget",
    ]
    assert books.notes("r:1") == []
    line = next(r for r in caplog.records if "data.example.org" in r.getMessage())
    assert "identity=abc" in line.getMessage() and "down=5000" in line.getMessage()


def test_the_proxy_resolves_the_names_of_the_hosts_file_but_not_loopback_ones(tmp_path: Path) -> None:
    hosts = tmp_path / "hosts"
    hosts.write_text("127.0.0.1 localhost\n10.1.2.3 data.test Data.Test # comment\n::1 ip6-localhost\nbad line\n")
    assert host_entries(hosts) == (("data.test", "10.1.2.3"),)
    assert host_entries(tmp_path / "missing") == ()
