"""Sizes: users write MiB (the ``_mb`` keys), every section gives them in bytes (``_bytes``), and
the code reads the bytes; the unit is defined once, in ``config.units``."""

from __future__ import annotations

import re
from pathlib import Path
from typing import Any

from pydantic import BaseModel

from mcp_code_exec.config.accounting import QuotaOverride
from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.config.units import MIB

ROOT = Path(__file__).resolve().parents[2]


def sections(model: BaseModel) -> list[BaseModel]:
    found = [model]
    for name in type(model).model_fields:
        value: Any = getattr(model, name)
        if isinstance(value, BaseModel) and not isinstance(value, QuotaOverride):
            found += sections(value)
    return found


def test_every_size_in_mib_is_given_in_bytes_too() -> None:
    odd = {"memory_mb": 333, "session_data_mb": 77, "max_body_mb": 3, "files_max_file_mb": 5, "max_mb": 9}
    config = load_config(
        environ={},
        overrides={
            "limits": {"memory_mb": odd["memory_mb"], "session_data_mb": odd["session_data_mb"]},
            "http": {"max_body_mb": odd["max_body_mb"]},
            "runs": {"files_max_file_mb": odd["files_max_file_mb"]},
            "audit": {"max_mb": odd["max_mb"]},
        },
    )
    checked = 0
    for section in sections(config):
        for name in type(section).model_fields:
            if name.endswith("_mb"):
                in_bytes = getattr(section, name.removesuffix("_mb") + "_bytes")
                assert in_bytes == getattr(section, name) * 1048576, (type(section).__name__, name)
                checked += 1
    assert checked >= 20
    assert config.limits.memory_bytes == 333 * 1048576 and config.audit.max_bytes == 9 * 1048576
    assert Config().limits.session_data_bytes == 1 << 30


def test_the_unit_is_defined_once() -> None:
    assert MIB == 1 << 20
    defined = [
        str(path.relative_to(ROOT))
        for path in sorted((ROOT / "mcp_code_exec").rglob("*.py"))
        if re.search(r"^MIB\s*=", path.read_text(), re.MULTILINE)
    ]
    assert defined == ["mcp_code_exec/config/units.py"]
