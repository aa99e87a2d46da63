"""``mcp-code-exec doctor`` on the real engine: all OK on a healthy setup, a clear FAIL otherwise."""

from __future__ import annotations

import pytest
from _support import make_test_config

from mcp_code_exec.commands.doctor import doctor
from mcp_code_exec.config.settings import Config

pytestmark = pytest.mark.anyio


async def test_a_healthy_setup_passes_every_check(config: Config, capsys: pytest.CaptureFixture[str]) -> None:
    assert await doctor(config) == 0
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert lines and all(line.startswith("OK ") for line in lines), out
    for check in (
        "engine",
        "image",
        "runtime",
        "sandbox start",
        "isolation",
        "syscall filter",
        "memory limit",
        "session",
    ):
        assert any(line.split()[1].rstrip(":") == check.split()[0] for line in lines), (check, out)


async def test_under_gvisor_the_doctor_finds_the_syscall_filter_in_force(
    config: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    from _security import runsc_available

    if not runsc_available():
        pytest.skip("gVisor (runsc) is not registered with the engine")
    assert await doctor(config.model_copy(update={"runtime": "runsc"})) == 0
    out = capsys.readouterr().out
    assert "OK    syscall filter: io_uring, userfaultfd and ptrace are refused" in out, out


async def test_a_missing_image_fails_and_names_the_build_command(capsys: pytest.CaptureFixture[str]) -> None:
    assert await doctor(make_test_config(image="mcp-code-exec:does-not-exist")) == 1
    out = capsys.readouterr().out
    assert "FAIL  image" in out and "mcp-code-exec image build" in out, out


async def test_no_engine_fails_and_says_how_to_start_one(capsys: pytest.CaptureFixture[str]) -> None:
    assert await doctor(make_test_config(docker_host="unix:///nonexistent/docker.sock")) == 1
    out = capsys.readouterr().out
    assert "FAIL  engine" in out and "start" in out, out


async def test_an_unregistered_runtime_fails_with_what_to_do(capsys: pytest.CaptureFixture[str]) -> None:
    assert await doctor(make_test_config(runtime="no-such-runtime")) == 1
    out = capsys.readouterr().out
    assert "FAIL  runtime" in out and "no-such-runtime" in out, out


async def test_with_the_count_alone_the_doctor_says_what_it_does_not_catch(
    config: Config, capsys: pytest.CaptureFixture[str]
) -> None:
    limits = config.limits.model_copy(update={"session_disk": "agent"})
    assert await doctor(config.model_copy(update={"limits": limits})) == 0
    out = capsys.readouterr().out
    assert "OK    session disk: only the sandbox's count guards the quota" in out and "memory mapping" in out, out
