"""Which zygote a stateless cell's worker comes from (``mcpx_agent.supervisor.routing``), and how a
lean worker sets up a data library it imports after all (``mcpx_agent.zygote.lean``)."""

from __future__ import annotations

import importlib
import importlib.util
import sys
import types
from pathlib import Path
from typing import Any

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent.supervisor.routing import MAX_PARSED, needs_libraries
from mcpx_agent.zygote.lean import ConfigureOnImport

LEAN = [
    "print(1 + 1)",
    "x = [i * i for i in range(10)]\nx",
    "import json, os.path\nfrom collections import Counter\nprint(json.dumps(Counter('aab')))",
    "from __future__ import annotations\nimport sys",
    "import mcp_tools",  # code mode's module, the agent's own
    "from IPython.display import display, HTML",  # the lean zygote holds IPython
    "# import pandas in a comment is only a comment\nprint('import numpy')",
    "%time 1",  # no import at all: a magic that imports nothing needs nothing
]
FULL = [
    "import numpy as np",
    "import pandas.io.json",
    "from matplotlib import pyplot as plt",
    "import os, sklearn",
    "from . import sibling",
    "m = __import__('json')",
    "import importlib\nimportlib.import_module('json')",
    "%matplotlib inline\nimport os",  # IPython syntax: not parsed, so not known
    "import json\n" + "(" * 300 + ")" * 300,  # too deeply nested to parse
    b"# -*- coding: no-such-codec -*-\nimport os".decode(),
    "import os\n" + "x = 1\n" * (MAX_PARSED // 6),  # too large to be worth parsing
]


@pytest.mark.parametrize("code", LEAN)
def test_a_cell_that_imports_only_the_standard_library_goes_to_the_lean_zygote(code: str) -> None:
    assert not needs_libraries(code.encode())


@pytest.mark.parametrize("code", FULL)
def test_a_cell_that_may_import_anything_else_goes_to_the_full_zygote(code: str) -> None:
    assert needs_libraries(code.encode())


def test_the_parsers_warnings_stay_quiet(recwarn: pytest.WarningsRecorder) -> None:
    assert not needs_libraries(b"import json\nx = 1if 1else 2")  # a SyntaxWarning when parsed
    # none reaches the supervisor's stderr (only the parser's kind is counted: a ResourceWarning from
    # another test's garbage, collected meanwhile, once failed this test in the whole suite)
    assert [str(warning.message) for warning in recwarn if issubclass(warning.category, SyntaxWarning)] == []


def test_a_module_imported_after_the_hook_is_set_up_once_and_the_hook_then_leaves(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lean_probe_lib.py").write_text("value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    seen: list[Any] = []

    def configure(module: types.ModuleType) -> None:
        module.value = 20  # type: ignore[attr-defined]
        seen.append(module.__name__)

    hook = ConfigureOnImport({"lean_probe_lib": configure})
    monkeypatch.setattr(sys, "meta_path", [hook, *sys.meta_path])
    module = importlib.import_module("lean_probe_lib")
    assert module.value == 20 and seen == ["lean_probe_lib"]
    assert hook not in sys.meta_path  # nothing left to set up
    sys.modules.pop("lean_probe_lib")
    assert importlib.import_module("lean_probe_lib").value == 1 and seen == ["lean_probe_lib"]
    sys.modules.pop("lean_probe_lib")


def test_looking_a_module_up_does_not_use_up_its_set_up(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "lean_probe_looked_up.py").write_text("value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def configure(module: types.ModuleType) -> None:
        module.value = 20  # type: ignore[attr-defined]

    monkeypatch.setattr(sys, "meta_path", [ConfigureOnImport({"lean_probe_looked_up": configure}), *sys.meta_path])
    assert importlib.util.find_spec("lean_probe_looked_up") is not None
    assert importlib.import_module("lean_probe_looked_up").value == 20
    sys.modules.pop("lean_probe_looked_up")


def test_a_set_up_that_fails_leaves_the_module_imported_as_it_is(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    (tmp_path / "lean_probe_broken.py").write_text("value = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))

    def configure(module: types.ModuleType) -> None:
        raise RuntimeError("a library of another version")

    monkeypatch.setattr(sys, "meta_path", [ConfigureOnImport({"lean_probe_broken": configure}), *sys.meta_path])
    assert importlib.import_module("lean_probe_broken").value == 1
    sys.modules.pop("lean_probe_broken")
