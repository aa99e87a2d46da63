"""Code mode on the real engine: sandbox code calls real upstream MCP servers through the broker.

Upstreams: PyPI ``mcp-server-time`` and ``mcp-server-git`` (2026-07-28 servers), the npm
``@modelcontextprotocol/server-everything`` (a 2025-era server, installed by ``.ci/run`` from
``fixtures/npm``), and ``fixtures/crashing_server.py`` (a server that dies mid-call). The MCP
server is driven with the ``mcp`` client, in both protocol eras where it matters.
"""

from __future__ import annotations

import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import anyio
import pytest
from _tasks_client import TasksClient, created
from mcp import Client
from mcp.client.context import ClientRequestContext
from mcp.types import CallToolResult, ElicitRequestParams, ElicitResult

from mcp_code_exec.config.code_mode import CodeModeSettings, UpstreamServer
from mcp_code_exec.config.settings import Config
from mcp_code_exec.mcp_server import build_server
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
FIXTURES = Path(__file__).parent / "fixtures"
EVERYTHING = FIXTURES / "npm" / "node_modules" / "@modelcontextprotocol" / "server-everything" / "dist" / "index.js"


def git_repository(path: Path) -> Path:
    path.mkdir()
    for command in (["init", "-q"], ["config", "user.email", "t@example.com"], ["config", "user.name", "T"]):
        subprocess.run(["git", *command], cwd=path, check=True)
    (path / "a.txt").write_text("one\n")
    subprocess.run(["git", "add", "a.txt"], cwd=path, check=True)
    subprocess.run(["git", "commit", "-qm", "first"], cwd=path, check=True)
    return path


def servers(repository: Path) -> list[UpstreamServer]:
    python = sys.executable
    listed = [
        UpstreamServer(name="time", command=python, args=["-m", "mcp_server_time"]),
        UpstreamServer(name="git", command=python, args=["-m", "mcp_server_git", "--repository", str(repository)]),
        UpstreamServer(name="flaky", command=python, args=[str(FIXTURES / "crashing_server.py")], env={"MARK": "m"}),
        UpstreamServer(name="secret", command=python, args=["-m", "mcp_server_time"], principals=["someone-else"]),
    ]
    if EVERYTHING.exists():
        listed.append(
            UpstreamServer(name="everything", command="node", args=[str(EVERYTHING)], allow=["echo", "get-*"])
        )
    return listed


@pytest.fixture(scope="module")
def code_mode_config(config: Config, tmp_path_factory: pytest.TempPathFactory) -> Config:
    repository = git_repository(tmp_path_factory.mktemp("code-mode") / "repo")
    settings = CodeModeSettings(servers=servers(repository), ask_timeout_s=60)
    return config.model_copy(update={"code_mode": settings})


@pytest.fixture(scope="module")
async def code_service(code_mode_config: Config) -> AsyncIterator[SandboxService]:
    async with SandboxService.start(code_mode_config) as svc:
        await svc.wait_ready()
        yield svc


def approving(answers: list[bool]) -> Any:
    async def callback(context: ClientRequestContext, params: ElicitRequestParams) -> ElicitResult:
        allow = answers.pop(0) if answers else False
        return ElicitResult(action="accept", content={"allow": allow})

    return callback


async def run(client: Client, code: str, **arguments: Any) -> dict[str, Any]:
    result: CallToolResult = await client.call_tool("run_python", {"code": code, **arguments})
    assert result.structured_content is not None, result
    return dict(result.structured_content)


async def test_a_tool_returns_its_structured_content_and_an_error_raises_tool_error(
    code_service: SandboxService,
) -> None:
    async with Client(build_server(code_service)) as client:
        out = await run(
            client,
            "import mcp_tools\n"
            "now = mcp_tools.time.get_current_time(timezone='UTC')\n"
            "print(type(now).__name__, now['timezone'])\n"
            "try:\n"
            "    mcp_tools.time.get_current_time(timezone='Not/AZone')\n"
            "except mcp_tools.ToolError as exc:\n"
            "    print('ToolError', type(exc).__name__, 'Not/AZone' in str(exc))\n",
        )
    assert out["status"] == "ok", out
    assert out["stdout"].splitlines() == ["dict UTC", "ToolError ToolError True"]


async def test_policy_allows_read_only_denies_destructive_and_a_client_that_cannot_ask_is_denied(
    code_service: SandboxService,
) -> None:
    code = (
        "import mcp_tools\n"
        "print('first' in mcp_tools.git.git_log(repo_path=REPO, max_count=1))\n"
        "for name in ('git_reset', 'git_commit'):\n"
        "    try:\n"
        "        getattr(mcp_tools.git, name)(repo_path=REPO, **({'message': 'm'} if name == 'git_commit' else {}))\n"
        "    except mcp_tools.ToolDenied as exc:\n"
        "        print(name, 'denied', isinstance(exc, PermissionError), 'declared no elicitation' in str(exc))\n"
    ).replace("REPO", repr(str(repository_of(code_service))))
    async with Client(build_server(code_service)) as client:  # no elicitation_callback: cannot ask
        out = await run(client, code)
    assert out["stdout"].splitlines() == ["True", "git_reset denied True False", "git_commit denied True True"], out


def repository_of(service: SandboxService) -> Path:
    git = next(server for server in service.config.code_mode.servers if server.name == "git")
    return Path(git.args[-1])


COMMIT = (
    "import mcp_tools, pathlib\n"
    "try:\n"
    "    print(mcp_tools.git.git_commit(repo_path=REPO, message=MESSAGE))\n"
    "except mcp_tools.ToolDenied as exc:\n"
    "    print('denied:', exc)\n"
)


def git(repository: Path, *arguments: str) -> str:
    return subprocess.run(["git", *arguments], cwd=repository, check=True, capture_output=True, text=True).stdout


def staged_change(repository: Path, name: str) -> tuple[str, str]:
    """A new file staged in the repository, so a git_commit has something to commit; (the code that
    commits it with a message of its own, the commit HEAD was)."""
    (repository / f"{name}.txt").write_text(name)
    git(repository, "add", f"{name}.txt")
    code = COMMIT.replace("REPO", repr(str(repository))).replace("MESSAGE", repr(f"commit {name}"))
    return code, git(repository, "rev-parse", "HEAD").strip()


def check_commit(repository: Path, name: str, head: str, allowed: bool, stdout: str) -> None:
    """Accepted: the commit is in git log; declined: nothing was committed (and the change is unstaged)."""
    messages = git(repository, "log", "--format=%s").splitlines()
    if allowed:
        assert "denied" not in stdout and messages[0] == f"commit {name}", (stdout, messages[:3])
        assert git(repository, "rev-parse", "HEAD~1").strip() == head
    else:
        assert "denied: the call needs a human's approval: the user answered accept (not allowed)" in stdout, stdout
        assert git(repository, "rev-parse", "HEAD").strip() == head and f"commit {name}" not in messages
        git(repository, "reset", "-q")


@pytest.mark.parametrize("allow", [True, False])
async def test_a_call_that_asks_waits_for_the_humans_answer_in_both_eras(
    code_service: SandboxService, mode: str, allow: bool
) -> None:
    repository = repository_of(code_service)
    name = f"{mode}-{allow}"
    code, head = staged_change(repository, name)
    asked: list[bool] = [allow]
    async with Client(build_server(code_service), mode=mode, elicitation_callback=approving(asked)) as client:
        out = await run(client, code)
    assert asked == [], out  # the human was asked once
    check_commit(repository, name, head, allow, out["stdout"])


@pytest.mark.parametrize("allow", [True, False])
async def test_a_tasks_client_is_asked_through_input_required_and_answers_with_tasks_update(
    code_service: SandboxService, allow: bool
) -> None:
    repository = repository_of(code_service)
    name = f"tasks-{allow}"
    code, head = staged_change(repository, name)
    forms: list[str] = []

    async def answer(params: ElicitRequestParams) -> ElicitResult:
        forms.append(params.message)
        return ElicitResult(action="accept", content={"allow": allow})

    pushed: list[bool] = []  # the Tasks path asks through the task, never by elicitation/create
    tasks_before = len(created)
    async with Client(
        build_server(code_service), extensions=[TasksClient(answer)], elicitation_callback=approving(pushed)
    ) as client:
        with anyio.fail_after(60):
            result: CallToolResult = await client.call_tool("run_python", {"code": code})
    out = result.structured_content or {}
    assert len(created) == tasks_before + 1, out  # it went as a task
    assert len(forms) == 1 and "'git_commit'" in forms[0] and "'git'" in forms[0], forms
    check_commit(repository, name, head, allow, str(out.get("stdout")))


async def test_the_run_budget_stops_the_51st_call_and_parallel_calls_are_capped(code_service: SandboxService) -> None:
    code = (
        "import mcp_tools\n"
        "futures = [mcp_tools.time.get_current_time.submit(timezone='UTC') for _ in range(12)]\n"
        "print(sum(isinstance(f.result(), dict) for f in futures))\n"
        "for i in range(38):\n"
        "    mcp_tools.time.get_current_time(timezone='UTC')\n"
        "try:\n"
        "    mcp_tools.time.get_current_time(timezone='UTC')\n"
        "except mcp_tools.ToolBudgetExceeded as exc:\n"
        "    print('budget', exc)\n"
    )
    async with Client(build_server(code_service)) as client:
        result: CallToolResult = await client.call_tool("run_python", {"code": code})
    out = result.structured_content or {}
    assert out.get("stdout", "").splitlines() == ["12", "budget this run has used its 50 tool calls"], out
    run = code_service.run_registry.get(str(out["run_id"]), "local")
    assert run.tool_budget is not None and 1 <= run.tool_budget.peak_in_flight <= 4
    assert out["usage"]["tool_calls"] == 50  # the one past the budget was refused in the sandbox


async def test_a_cell_that_goes_on_calling_past_its_budget_is_refused_each_time_and_finishes(
    code_service: SandboxService,
) -> None:
    code = (
        "import mcp_tools\n"
        "refused = 0\n"
        "for i in range(300):\n"
        "    try:\n"
        "        mcp_tools.time.get_current_time(timezone='UTC')\n"
        "    except mcp_tools.ToolBudgetExceeded:\n"
        "        refused += 1\n"
        "futures = [mcp_tools.time.get_current_time.submit(timezone='UTC') for _ in range(2)]\n"
        "def outcome(future):\n"
        "    try:\n"
        "        return type(future.result()).__name__\n"
        "    except mcp_tools.ToolBudgetExceeded as exc:\n"
        "        return str(exc)\n"
        "print(refused, [outcome(future) for future in futures])\n"
    )
    async with Client(build_server(code_service)) as client:
        out = await run(client, code)
    budget = "this run has used its 50 tool calls"
    assert out["status"] == "ok" and out["stdout"] == f"250 {[budget, budget]}\n", out
    assert out["usage"]["tool_calls"] == 50


async def test_another_identitys_server_is_not_listed_and_a_forged_call_is_refused(
    code_service: SandboxService,
) -> None:
    code = (
        "import mcp_tools, json, os\n"
        "print(mcp_tools.servers())\n"
        "from mcpx_agent.worker.mcp_tools import CHANNEL\n"
        "try:\n"
        "    CHANNEL.wait(CHANNEL.send('secret', 'get_current_time', {'timezone': 'UTC'}, False))\n"
        "except mcp_tools.ToolDenied as exc:\n"
        "    print('refused:', exc)\n"
    )
    async with Client(build_server(code_service)) as client:
        out = await run(client, code)
    lines = out["stdout"].splitlines()
    assert "secret" not in lines[0] and "time" in lines[0], out
    assert lines[1] == "refused: no tool server of that name is available to this caller", out


async def test_hostile_call_frames_leave_the_server_and_other_clients_unaffected(code_service: SandboxService) -> None:
    code = (
        "import json, os\n"
        "from mcpx_agent import protocol\n"
        "from mcpx_agent.worker.mcp_tools import CHANNEL\n"
        'UTC = b\'{"timezone": "UTC"}\'\n'
        "deep = ('[' * 5000 + ']' * 5000).encode()\n"
        "for call, server, payload in ((1001, 'time', deep), (1002, 'nope' * 10, b'{}'), (1003, 'time', b'not json')):\n"
        "    protocol.send(3, {'kind': 'call', 'call': call, 'server': server, 'tool': 'get_current_time'}, payload)\n"
        "    try:\n"
        "        CHANNEL.wait(call)\n"
        "    except Exception as exc:\n"
        "        print(type(exc).__name__)\n"
        "for call in range(2000, 2080):\n"  # a flood: only meets the budget, the refused calls spent it too
        "    protocol.send(3, {'kind': 'call', 'call': call, 'server': 'time', 'tool': 'get_current_time'}, UTC)\n"
        "print(sum(1 for call in range(2000, 2080) if _ok(call)))\n"
    ).replace(
        "print(sum(",
        "def _ok(call):\n    try:\n        CHANNEL.wait(call); return True\n    except Exception:\n        return False\nprint(sum(",
    )
    async with Client(build_server(code_service)) as client:
        out = await run(client, code)
        assert out["stdout"].splitlines() == ["ToolArgumentError", "ToolDenied", "ToolArgumentError", "47"], out
        flood = (
            "from mcpx_agent import protocol\n"
            "for call in range(50000):\n"
            "    protocol.send(3, {'kind': 'call', 'call': call, 'server': 'nope', 'tool': 't'}, b'{}')\n"
        )
        out = await run(client, flood, timeout=60)
        assert out["status"] == "crashed" and "more than 100 tool calls" in out["error"]["message"], out
        oversized = "from mcpx_agent import protocol\nprotocol.send(3, {'kind': 'call', 'call': 1, 'server': 't', 'tool': 't'}, b'x' * (300 << 10))\nimport time; time.sleep(30)\n"
        out = await run(client, oversized, timeout=20)
        assert out["status"] == "error" and "over 262144 bytes" in out["error"]["message"], out
        after = await run(
            client, "import mcp_tools\nprint(mcp_tools.time.get_current_time(timezone='UTC')['timezone'])"
        )
    assert after["stdout"] == "UTC\n"


async def test_an_upstream_that_crashes_mid_call_is_unavailable_and_restarted(code_service: SandboxService) -> None:
    code = (
        "import mcp_tools\n"
        "first = mcp_tools.flaky.echo(text='a')\n"
        "try:\n"
        "    mcp_tools.flaky.crash()\n"
        "except mcp_tools.ToolUnavailable as exc:\n"
        "    print('unavailable', isinstance(exc, ConnectionError))\n"
        "env = mcp_tools.flaky.environment()\n"
        "print(env['MARK'], 'MCP_CODE_EXEC_TOKEN' in env)\n"
    )
    async with Client(build_server(code_service)) as client:
        out = await run(client, code)
        again = await run(
            client, "import mcp_tools\nprint(mcp_tools.flaky.echo(text='b')['result'].startswith('b from'))"
        )
    assert out["stdout"].splitlines() == ["unavailable True", "m False"], out
    assert again["stdout"] == "True\n", again


@pytest.mark.skipif(not EVERYTHING.exists(), reason="npm fixtures not installed (npm ci in tests/engine/fixtures/npm)")
async def test_a_2025_era_npm_server_works_and_keeps_camel_case_arguments(code_service: SandboxService) -> None:
    code = (
        "import mcp_tools, inspect\n"
        "print(mcp_tools.everything.echo(message='hello'))\n"
        "print(sorted(p for p in inspect.signature(mcp_tools.everything.get_annotated_message).parameters))\n"
    )
    async with Client(build_server(code_service)) as client:
        out = await run(client, code)
    lines = out["stdout"].splitlines()
    assert "hello" in lines[0], out
    assert "messageType" in lines[1], out
