"""The supervisor stays a small interpreter: every module it imports is held twice in every
container (see ``mcpx_agent.supervisor``), so the heavy stdlib modules stay out of it."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

AGENT = Path(__file__).resolve().parents[2] / "images" / "python" / "agent"
# Each of these would add hundreds of kilobytes to every container's supervisor.
HEAVY = ("typing", "dataclasses", "inspect", "ast", "tokenize", "dis", "numpy", "IPython")


def test_the_supervisor_imports_none_of_the_heavy_modules() -> None:
    probe = (
        "import json, sys\n"
        "before = set(sys.modules)\n"
        "from mcpx_agent import supervisor, zygote\n"
        "print(json.dumps(sorted(set(sys.modules) - before)))\n"
    )
    out = subprocess.run(
        [sys.executable, "-I", "-c", f"import sys; sys.path.insert(0, {str(AGENT)!r})\n{probe}"],
        capture_output=True,
        text=True,
        check=True,
        timeout=60,
    )
    loaded = set(json.loads(out.stdout))
    assert "mcpx_agent.supervisor" in loaded
    assert sorted(loaded & set(HEAVY)) == []
