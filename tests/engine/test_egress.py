"""Controlled egress on the real engine, under runc and gVisor (docs/egress.md, docs/security.md#egress).

The sandboxes reach test hosts of the tests' own (``_egress_hosts``: network namespaces with HTTP and
HTTPS servers whose certificate is of a test CA, given as ``upstream_ca``; names from a hosts file
of the tests' own) through the real proxy (its image built from the package registries' wheels).
Nothing is mocked: requests, urllib, httpx, pip, curl and git run in the sandbox as a user's code
would run them.
"""

from __future__ import annotations

import json
import os
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path

import _egress
import anyio
import pytest
from _egress import ALICE, BOB, CLIENT, egress_service, egress_test_hosts, run, said
from _egress_hosts import EgressHosts, missing_tools, sandbox_wheels
from _security import runsc_available, runsc_leftovers
from _support import in_fresh_thread, wait_until

from mcp_code_exec.errors import SandboxError
from mcp_code_exec.observability import metrics
from mcp_code_exec.service.facade import SandboxService

pytestmark = [pytest.mark.anyio, pytest.mark.skipif(missing_tools() is not None, reason=str(missing_tools()))]
SECRET = "s3cr3t-egress-" + os.urandom(8).hex()
RUNTIMES = [
    "runc",
    pytest.param("runsc", marks=pytest.mark.skipif(not runsc_available(), reason="gVisor is not registered as runsc")),
]


@pytest.fixture(scope="module")
def hosts() -> Iterator[EgressHosts]:
    with egress_test_hosts(SECRET, in_fresh_thread(sandbox_wheels, ["requests", "httpx"])) as made:
        yield made


@pytest.fixture(scope="module", params=RUNTIMES)
async def egress(
    request: pytest.FixtureRequest, hosts: EgressHosts, tmp_path_factory: pytest.TempPathFactory
) -> AsyncIterator[SandboxService]:
    runtime = str(request.param)
    async with egress_service(hosts, tmp_path_factory.mktemp("egress-state"), runtime) as service:
        yield service
    if runtime == "runsc":
        await wait_until(lambda: not runsc_leftovers(), 30)


async def test_allowed_hosts_answer_urllib_requests_httpx_pip_curl_and_git(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    data, files, git = hosts.name("data"), "a.files.egress.test", hosts.name("git")
    code = f"""
found = {{}}
found["pip"] = sh(sys.executable, "-m", "pip", "install", "--quiet", "--target", "/tmp/site",
                  "--index-url", "https://{hosts.name("pypi")}/simple/", "requests", "httpx", "egress-probe-pkg")
sys.path.insert(0, "/tmp/site")
import requests, httpx, egress_probe_pkg
found["installed"] = egress_probe_pkg.VALUE
found["urllib_https"] = get("https://{data}/echo")["status"]
found["urllib_http"] = get("http://{data}/echo")["status"]
found["port_entry"] = get("https://{data}:8443/echo")["status"]
found["wildcard"] = get("https://{files}/echo")["status"]
found["address_entry"] = get("http://{hosts.first}:9000/echo")["status"]
found["requests"] = requests.get("https://{data}/echo", timeout=30).status_code
found["httpx"] = httpx.get("https://{data}/echo", timeout=30).status_code
curl = sh("curl", "-sS", "-o", "/dev/null", "-w", "%{{http_code}}", "https://{data}/echo")
found["curl"] = curl["out"] or curl["err"]
clone = sh("git", "clone", "-q", "https://{git}/git/demo.git", "/tmp/demo")
found["git"] = open("/tmp/demo/README").read() if clone["rc"] == 0 else clone["err"]
print(json.dumps(found))
"""
    found = said(await run(egress, ALICE, code))
    assert found["pip"]["rc"] == 0, found["pip"]
    assert found["installed"] == 42
    for client in ("urllib_https", "urllib_http", "port_entry", "wildcard", "address_entry", "requests", "httpx"):
        assert found[client] == 200, (client, found)
    assert found["curl"] == "200"
    assert found["git"] == "reached through the egress proxy\n"


async def test_what_is_not_allowed_fails_with_the_refusal(egress: SandboxService, hosts: EgressHosts) -> None:
    code = f"""
print(json.dumps({{
    "host_https": get("https://evil.egress.test/"), "host_http": get("http://evil.egress.test/"),
    "other_port": get("https://{hosts.name("data")}:9000/"),
    "address": get("https://{hosts.first}/echo"), "private_name": get("https://{hosts.name("internal")}/"),
    "loopback_name": get("http://{hosts.name("loop")}/"), "metadata_name": get("http://{hosts.name("metadata")}/"),
    "metadata": get("http://169.254.169.254/latest/meta-data/"), "v6_mapped": get("http://[::ffff:{hosts.first}]/"),
    "tcp": tcp("{hosts.first}", 443), "tcp_metadata": tcp("169.254.169.254", 80), "udp": udp("{hosts.first}", 5353),
    "curl": sh("curl", "-sS", "https://evil.egress.test/"),
}}))
"""
    found = said(await run(egress, ALICE, code))
    assert "403 egress refused: host 'evil.egress.test' (port 443) is not allowed" in found["host_https"]["error"]
    assert found["host_http"]["status"] == 403 and "[egress] allow" in found["host_http"]["body"]
    assert "'evil.egress.test'" in found["host_http"]["body"]
    assert "(port 9000) is not allowed" in found["other_port"]["error"]
    assert f"host '{hosts.first}' (port 443) is not allowed" in found["address"]["error"]
    for name in ("private_name", "loopback_name", "metadata_name"):
        refusal = found[name].get("error") or found[name].get("body")
        assert "not a public address" in refusal and "[egress] private_ranges" in refusal, (name, refusal)
    assert found["metadata"]["status"] == 403 and "169.254.169.254" in found["metadata"]["body"]
    assert found["v6_mapped"]["status"] == 403
    for raw in ("tcp", "tcp_metadata", "udp"):
        assert "unreachable" in found[raw]["error"].lower() or "Errno" in found[raw]["error"], found[raw]
    assert found["curl"]["rc"] != 0 and "403" in found["curl"]["err"]


async def test_the_secret_reaches_its_host_alone_and_appears_nowhere_else(
    egress: SandboxService, hosts: EgressHosts, caplog: pytest.LogCaptureFixture
) -> None:
    caplog.set_level("DEBUG")
    api, data = hosts.name("api"), hosts.name("data")
    code = f"""
import pathlib
found = {{"https": get("https://{api}/secret-check"), "http": get("http://{api}/secret-check"),
         "forged": get("https://{api}/secret-check", {{"Authorization": "Bearer forged"}}),
         "forged_http": get("http://{api}/secret-check", {{"Authorization": "Bearer forged"}}),
         "other_host": get("https://{data}/secret-check")}}
needle = {SECRET!r}.encode()
seen = [name for name, value in os.environ.items() if needle.decode() in value]
for pid in os.listdir("/proc"):
    for part in ("environ", "cmdline"):
        try:
            if pid.isdigit() and needle in open(f"/proc/{{pid}}/{{part}}", "rb").read():
                seen.append(f"/proc/{{pid}}/{{part}}")
        except OSError:
            pass
grep = sh("grep", "-rlsF", "--exclude-dir=proc", "--exclude-dir=sys", "--exclude-dir=dev", needle.decode(), "/", timeout=550)
seen += grep["out"].split() + ([grep["err"] or "grep failed"] if grep["rc"] not in (0, 1, 2) else [])  # 2: unreadable files
found["seen"] = seen
print(json.dumps(found))
"""
    with _egress.proxy_output(egress) as proxy:  # the proxy container's own output, stderr (its log) and stdout
        result = await run(egress, ALICE, code, limit_s=580)
    found = said(result)
    for way in ("https", "http", "forged", "forged_http"):  # the sandbox's own header is replaced, not merged
        assert json.loads(found[way]["body"]) == {"matched": True, "count": 1}, (way, found[way])
    assert json.loads(found["other_host"]["body"]) == {"matched": False, "count": 0}
    assert found["seen"] == []
    assert SECRET not in result.model_dump_json()
    assert SECRET not in caplog.text and "s3cr3t" not in caplog.text
    assert SECRET.encode() not in metrics.exposition()
    assert f'"host":"{api}"' in proxy["stdout"], proxy  # its records of this run: the capture was live
    assert all(SECRET not in proxy[stream] and "s3cr3t" not in proxy[stream] for stream in ("stdout", "stderr"))


async def test_two_identities_with_different_principals_reach_different_hosts(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    code = f'print(json.dumps([get("https://{hosts.name("api")}/secret-check"), get("https://{hosts.name("data")}/echo")]))'
    alice, bob = said(await run(egress, ALICE, code)), said(await run(egress, BOB, code))
    assert alice[0]["status"] == 200 and alice[1]["status"] == 200
    assert "not for this session" in bob[0]["error"] and bob[1]["status"] == 200
    assert hosts.name("api") in egress.egress.describe(ALICE) and hosts.name("api") not in egress.egress.describe(BOB)


async def test_a_session_narrows_at_start_and_while_it_runs_and_its_forks_inherit(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    data, files = hosts.name("data"), "a.files.egress.test"
    made = await egress.new_session(ALICE, [data, "*.files.egress.test"])
    session = made.session_id
    try:
        assert made.egress == [data, "*.files.egress.test"]
        code = f'print(json.dumps([get("https://{data}/echo").get("status"), get("https://{hosts.name("api")}/").get("error", "")]))'
        reached = said(await run(egress, ALICE, code, session))
        assert reached[0] == 200 and "not for this session" in reached[1]
        # "fetch the data, then isolate": a run going on is cut off when its session is narrowed
        loop = f"""
import time
statuses = []
for _ in range(100):
    statuses.append(get("https://{files}/echo", timeout=5).get("status", "refused"))
    if statuses[-1] != 200:
        break
    time.sleep(0.1)
print(json.dumps(statuses))
"""
        going = await egress.start_run(ALICE, CLIENT + loop, session_id=session, timeout=60)
        await anyio.sleep(2)  # let it make a few requests first (the test's own pacing)
        assert (await egress.restrict_egress(ALICE, session, [])).egress == []
        with anyio.fail_after(60):
            await going.finished.wait()
        statuses = said(egress.deliver(going))
        assert statuses[0] == 200 and statuses[-1] == "refused", statuses
        with pytest.raises(SandboxError, match="can only be narrowed"):
            await egress.restrict_egress(ALICE, session, [data])
        (fork,) = await egress.fork_session(ALICE, session)
        try:
            cut = said(await run(egress, ALICE, f'print(json.dumps(get("https://{data}/echo")))', fork))
            assert "not for this session" in cut["error"]
        finally:
            await egress.close_session(ALICE, fork)
    finally:
        await egress.close_session(ALICE, session)


async def test_a_budget_stops_a_run_past_it_and_the_next_run_starts_again(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    data = hosts.name("data")
    code = f"""
got, error = 0, ""
try:
    with urllib.request.urlopen("https://{data}/big?n={12 << 20}", timeout=60) as response:
        while chunk := response.read(1 << 16):
            got += len(chunk)
except Exception as exc:
    error = f"{{type(exc).__name__}}: {{exc}}"
after = get("http://{data}/echo")
print(json.dumps({{"got": got, "big": error, "after": after}}))
"""
    result = await run(egress, ALICE, code)
    found = said(result)
    assert found["got"] < 5 << 20 and found["after"]["status"] == 403, found  # 4 MiB a run
    assert "budget_run_mb" in found["after"]["body"]
    assert any("budget_run_mb" in note for note in result.notes) or result.notes == [], result.notes
    assert said(await run(egress, ALICE, f'print(json.dumps(get("https://{data}/echo")["status"]))')) == 200


async def test_a_day_budget_stops_the_run_that_goes_past_it(hosts: EgressHosts, tmp_path: Path) -> None:
    """``budget_day_mb`` counts an identity's bytes over its day's runs: the second of two runs that
    move more than it is cut, and its next request refused, naming the setting."""
    data = hosts.name("data")
    code = f"""
got, error = 0, ""
try:
    with urllib.request.urlopen("https://{data}/big?n={2 << 20}", timeout=60) as response:
        while chunk := response.read(1 << 16):
            got += len(chunk)
except Exception as exc:
    error = f"{{type(exc).__name__}}: {{exc}}"
print(json.dumps({{"got": got, "error": error, "after": get("http://{data}/echo")}}))
"""
    async with egress_service(hosts, tmp_path, "runc", egress={"budget_run_mb": 0, "budget_day_mb": 3}) as service:
        first = said(await run(service, ALICE, code))
        assert first["got"] == 2 << 20 and first["after"]["status"] == 200, first
        second = said(result := await run(service, ALICE, code))
        assert second["got"] < 2 << 20, second  # cut once the day's 3 MiB were used
        assert second["after"]["status"] == 403 and "budget_day_mb" in second["after"]["body"], second
        assert any("budget_day_mb" in note for note in result.notes), result.notes
        assert said(await run(service, BOB, code))["got"] == 2 << 20  # another identity's day is its own


async def test_egress_survives_a_pause_and_fails_closed_while_its_proxy_restarts(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    data = hosts.name("data")
    ask = f'print(json.dumps(get("https://{data}/echo").get("status")))'
    made = await egress.new_session(ALICE)
    try:
        assert said(await run(egress, ALICE, ask, made.session_id)) == 200
        session = egress.sessions.get(made.session_id, ALICE)
        assert await egress.keeper.pause(session)
        assert said(await run(egress, ALICE, ask, made.session_id)) == 200  # resumed in a new container
        outward = egress.egress.egress
        assert outward is not None and outward.proxy.container_id is not None
        starts, killed = outward.proxy.starts, outward.proxy.container_id
        await anyio.to_thread.run_sync(
            lambda: subprocess.run(["docker", "kill", killed], capture_output=True, check=False)
        )
        await wait_until(lambda: not outward.proxy.ready.is_set(), 30)
        # Until it answers again, egress fails closed, saying why (the server starts it again after a pause)
        down = said(await run(egress, ALICE, f'print(json.dumps(get("https://{data}/echo")))', made.session_id))
        assert "egress unavailable" in down.get("error", ""), down
        await wait_until(lambda: outward.proxy.starts > starts and outward.proxy.ready.is_set(), 90)
        assert said(await run(egress, ALICE, ask, made.session_id)) == 200
        assert said(await run(egress, ALICE, ask)) == 200
    finally:
        await egress.close_session(ALICE, made.session_id)


async def test_a_durable_sessions_narrowing_outlives_its_server(hosts: EgressHosts, tmp_path: Path) -> None:
    """The narrowing is in the session's record: the next server, taking the session over, keeps it."""
    data, files = hosts.name("data"), "a.files.egress.test"
    durable = {"sessions": {"max_sessions": 4, "durable": True, "scope": f"test-egress-{os.urandom(4).hex()}"}}
    async with egress_service(hosts, tmp_path, "runc", **durable) as first:
        made = await first.new_session(ALICE)
        assert (await first.restrict_egress(ALICE, made.session_id, [data])).egress == [data]
    async with egress_service(hosts, tmp_path, "runc", **durable) as second:
        try:
            ask = f'print(json.dumps([get("https://{data}/echo").get("status"), get("https://{files}/echo").get("error", "")]))'
            reached = said(await run(second, ALICE, ask, made.session_id))
            assert reached[0] == 200 and "not for this session" in reached[1], reached
        finally:
            await second.close_session(ALICE, made.session_id)


async def test_a_request_naming_another_host_than_its_connection_is_refused(
    egress: SandboxService, hosts: EgressHosts
) -> None:
    """The CONNECT target, the TLS server name and the Host header must name one host."""
    data, api = hosts.name("data"), hosts.name("api")
    code = f"""
import base64, ssl
token = os.environ["HTTPS_PROXY"].split("run:", 1)[1].split("@", 1)[0]
auth = "Basic " + base64.b64encode(f"run:{{token}}".encode()).decode()
def tunnel(target, sni, host, path):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=15)
    s.sendall(f"CONNECT {{target}} HTTP/1.1\\r\\nHost: {{target}}\\r\\nProxy-Authorization: {{auth}}\\r\\n\\r\\n".encode())
    head = s.recv(4096).decode("latin-1").split("\\r\\n")[0]
    if " 200" not in head:
        return head
    context = ssl.create_default_context(); context.check_hostname = False  # the proxy's answer is what is tested
    try:
        t = context.wrap_socket(s, server_hostname=sni)
        t.sendall(f"GET {{path}} HTTP/1.1\\r\\nHost: {{host}}\\r\\nConnection: close\\r\\n\\r\\n".encode())
        answer = b""
        while chunk := t.recv(65536):
            answer += chunk
        return answer.decode("latin-1").split("\\r\\n")[0] + " " + answer.decode("latin-1")[-80:]
    except OSError as e:
        return f"{{type(e).__name__}}: {{e}}"
def plain(url, host):
    s = socket.create_connection(("127.0.0.1", 3128), timeout=15)
    s.sendall(f"GET {{url}} HTTP/1.1\\r\\nHost: {{host}}\\r\\nProxy-Authorization: {{auth}}\\r\\nConnection: close\\r\\n\\r\\n".encode())
    answer = b""
    while chunk := s.recv(65536):
        answer += chunk
    return answer.decode("latin-1").split("\\r\\n")[0]
print(json.dumps({{
    "sni_secret_host": tunnel("{data}:443", "{api}", "{api}", "/secret-check"),
    "host_other_in_secret_tunnel": tunnel("{api}:443", "{api}", "{data}", "/echo"),
    "sni_other_tunnelled": tunnel("{data}:443", "evil.egress.test", "{data}", "/echo"),
    "plain_host_other": plain("http://{data}/echo", "evil.egress.test"),
    "mixed_case_dot_refused": get("http://EVIL.egress.TEST./"),
    "mixed_case_dot_allowed": get("http://DATA.Egress.Test./echo").get("status"),
}}))
"""
    found = said(await run(egress, ALICE, code))
    assert "403" in found["sni_secret_host"] and "matched" not in found["sni_secret_host"], found
    assert "403" in found["host_other_in_secret_tunnel"], found
    assert "200 OK" not in found["sni_other_tunnelled"], found  # cut before a byte reaches the upstream
    assert "403" in found["plain_host_other"], found
    assert found["mixed_case_dot_refused"]["status"] == 403 and found["mixed_case_dot_allowed"] == 200
