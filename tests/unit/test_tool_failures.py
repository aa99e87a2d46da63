"""Whether a run's result is a tool failure (``isError``) comes from the error tree, not from names."""

from __future__ import annotations

import pytest

from mcp_code_exec.errors import (
    EngineDown,
    EngineUnavailable,
    ImageMissing,
    PackageError,
    ProtocolViolation,
    SandboxLost,
)
from mcp_code_exec.mcp_server.answers import run_content
from mcp_code_exec.models import ErrorInfo, RunResult
from mcp_code_exec.service.outcomes import container_lost_error, failed


def result_with(error: ErrorInfo) -> RunResult:
    return RunResult(status="error", error=error)


@pytest.mark.parametrize(
    "error",
    [
        failed(EngineDown("engine-2 is out: engine unavailable, retry later")),
        failed(EngineUnavailable("no engine answers")),
        failed(ImageMissing("the sandbox image is absent")),
        failed(RuntimeError("a bug of ours")),
        container_lost_error(SandboxLost("the container died")),
        container_lost_error(ProtocolViolation("a forged frame")),
    ],
    ids=lambda error: error.type,
)
def test_a_run_the_tool_failed_under_is_an_error_result(error: ErrorInfo) -> None:
    assert run_content(result_with(error), links=False).is_error


@pytest.mark.parametrize("name", ["SandboxLost", "EngineDown", "InternalError", "ZeroDivisionError"])
def test_the_users_own_exception_is_a_normal_result_whatever_it_is_called(name: str) -> None:
    """User code can raise a class named like one of ours; its result is still the user's error."""
    assert not run_content(result_with(ErrorInfo(type=name, message="raised by the cell")), links=False).is_error


def test_a_refused_install_is_the_users_error_not_the_tools() -> None:
    assert not run_content(result_with(failed(PackageError("no such package"))), links=False).is_error
