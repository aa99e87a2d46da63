"""The resource URI scheme is built and parsed in one place, and parses only what it builds."""

from __future__ import annotations

import pytest

from mcp_code_exec.service import uris


def test_what_is_built_parses_back() -> None:
    assert uris.parse(uris.session_file_uri("s_abc", "dir/a b.txt")) == uris.SandboxUri(
        "session_file", "s_abc", "dir/a b.txt"
    )
    assert uris.parse(uris.run_file_uri("r_x-1", "out.csv")) == uris.SandboxUri("run_file", "r_x-1", "out.csv")
    assert uris.parse(uris.run_output_uri("r_x")) == uris.SandboxUri("run_output", "r_x", None)


@pytest.mark.parametrize(
    "uri", ["file:///etc/passwd", "sandbox://sessions//files/a", "sandbox://sessions/a/b/files/c", "sandbox://runs/x"]
)
def test_anything_else_is_not_ours(uri: str) -> None:
    assert uris.parse(uri) is None


def test_mime_types_come_from_the_file_name() -> None:
    assert uris.guess_mime("a.png") == "image/png"
    assert uris.guess_mime("noext") == "application/octet-stream"
