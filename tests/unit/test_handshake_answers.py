"""The handshake answers a local service keeps for new fronts: only an exact request gets a kept
answer, and a file that is not the service's own is no answer at all."""

from __future__ import annotations

import json
import os
from pathlib import Path

from mcp_code_exec.commands.stdio.handshake import (
    MAX_FILE_BYTES,
    answer_line,
    kept_answer,
    load_answers,
    read_first_line,
    remember_answer,
)

PARAMS: dict[str, object] = {"protocolVersion": "2025-06-18", "capabilities": {}, "clientInfo": {"name": "c"}}
INITIALIZE: dict[str, object] = {"jsonrpc": "2.0", "id": 1, "method": "initialize", "params": PARAMS}
RESULT = {"protocolVersion": "2025-06-18", "serverInfo": {"name": "mcp-code-exec", "version": "0"}}


def line(message: object) -> bytes:
    return json.dumps(message).encode() + b"\n"


def test_a_remembered_answer_answers_the_same_request_under_the_clients_own_id(tmp_path: Path) -> None:
    path = tmp_path / "answers.json"
    remember_answer(path, INITIALIZE, RESULT)
    again = {**INITIALIZE, "id": "abc"}
    found = kept_answer(
        line(again) + b'{"jsonrpc": "2.0", "method": "notifications/initialized"}\n', load_answers(path)
    )
    assert found is not None
    assert json.loads(answer_line(*found)) == {"jsonrpc": "2.0", "id": "abc", "result": RESULT}


def test_other_params_another_method_or_a_partial_line_get_no_kept_answer(tmp_path: Path) -> None:
    path = tmp_path / "answers.json"
    remember_answer(path, INITIALIZE, RESULT)
    answers = load_answers(path)
    other_client = {**INITIALIZE, "params": {**PARAMS, "clientInfo": {"name": "d"}}}
    assert kept_answer(line(other_client), answers) is None
    assert kept_answer(line({"jsonrpc": "2.0", "id": 1, "method": "tools/list"}), answers) is None
    assert kept_answer(line(INITIALIZE)[:-1], answers) is None  # no line end: not a whole request
    assert kept_answer(line({**INITIALIZE, "id": None}), answers) is None  # a notification is not answered
    assert kept_answer(b"not json\n", answers) is None


def test_a_file_that_is_not_the_services_own_is_no_answer(tmp_path: Path) -> None:
    path = tmp_path / "answers.json"
    remember_answer(path, INITIALIZE, RESULT)
    text = path.read_bytes()
    assert load_answers(path)
    path.write_bytes(b"{garbage")
    assert load_answers(path) == {}
    path.write_text(json.dumps({"format": 99, "answers": {}}))
    assert load_answers(path) == {}
    path.write_bytes(b" " * (MAX_FILE_BYTES + 1))
    assert load_answers(path) == {}
    real = tmp_path / "real.json"
    real.write_bytes(text)
    path.unlink()
    path.symlink_to(real)
    assert load_answers(path) == {}  # never followed


def test_the_kept_file_is_private(tmp_path: Path) -> None:
    path = tmp_path / "answers.json"
    remember_answer(path, INITIALIZE, RESULT)
    assert path.stat().st_mode & 0o777 == 0o600


def test_the_first_line_is_read_whole_even_in_pieces(tmp_path: Path) -> None:
    read, write = os.pipe()
    try:
        os.write(write, line(INITIALIZE)[:10])
        os.write(write, line(INITIALIZE)[10:] + b"{")
        os.close(write)
        assert read_first_line(read, 8).startswith(line(INITIALIZE))
    finally:
        os.close(read)
