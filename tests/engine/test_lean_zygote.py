"""A stateless cell that imports nothing beyond the standard library runs in a worker of the lean
zygote, which holds none of the data libraries; every other cell, and every session's, in one of
the full zygote's. Both run any cell alike (see ``mcpx_agent.zygote.lean``)."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from _support import make_test_config

from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
OWNER = "lean-zygote"
PRELOADED = "import sys\nprint('pandas' in sys.modules, 'matplotlib.pyplot' in sys.modules)\n"


@pytest.fixture(scope="module")
async def service() -> AsyncIterator[SandboxService]:
    """One stateless container, so that each run takes the spare the one before it left."""
    async with SandboxService.start(make_test_config(pool={"size": 1, "session_spares": 1})) as service:
        await service.wait_ready()
        yield service


async def lean_streak(service: SandboxService) -> None:
    """Lean cells enough in a row that the next spare is the lean zygote's (``LEAN_SPARE_AFTER``)."""
    for _ in range(2):
        assert (await service.run(OWNER, "print(1)")).stdout == "1\n"


async def test_a_cell_of_the_standard_library_runs_without_the_data_libraries_loaded(service: SandboxService) -> None:
    await service.run(OWNER, "import numpy")  # a full cell: the next spare is the full zygote's
    outputs = [(await service.run(OWNER, PRELOADED)).stdout for _ in range(4)]
    # two lean cells in a row run in full workers, and make the next spare a lean one
    assert outputs == ["True True\n"] * 2 + ["False False\n"] * 2, outputs


async def test_a_cell_that_imports_a_data_library_finds_it_preloaded(service: SandboxService) -> None:
    await lean_streak(service)  # a lean spare waits: this cell must not take it
    full = await service.run(OWNER, PRELOADED + "import numpy\n")
    assert full.stdout == "True True\n", full
    magic = await service.run(OWNER, "%time " + PRELOADED.replace("\n", "; ").rstrip("; "))
    assert magic.stdout.startswith("True True\n"), magic  # IPython syntax: the full zygote's


async def test_a_data_library_a_lean_cell_imports_after_all_is_set_up_as_the_preloaded_one(
    service: SandboxService,
) -> None:
    """pandas' display options and pyplot's ``show`` as the full zygote sets them, whichever way the
    cell reached the import."""
    probe = (
        "import sys\n"
        "lean = 'pandas' not in sys.modules\n"
        "exec('import pandas as pd, matplotlib, matplotlib.pyplot as plt')\n"
        "print(lean, pd.get_option('display.max_rows'), matplotlib.get_backend())\n"
        "plt.plot([1, 2]); plt.show()\n"
    )
    for _ in range(2):
        await lean_streak(service)
        result = await service.run(OWNER, probe)
        assert result.status == "ok", result
        assert result.stderr == "", result
    assert result.stdout.lower() == "true 20 agg\n", result
    assert [image.data[:4] for image in result.images] == [b"\x89PNG"], result


async def test_precision_applies_to_numpys_floats_in_either_zygotes_worker(service: SandboxService) -> None:
    """IPython prints numpy's float64 as a float (so ``%precision`` applies) when numpy is loaded at a
    process's first display; the zygotes display before any fork, the lean one before numpy."""
    precise = "get_ipython().run_line_magic('precision', '3')\nnp.float64(1.23456), [np.float64(2.5)]"
    await lean_streak(service)
    lean = await service.run(OWNER, "import sys\nprint('numpy' in sys.modules)\nexec('import numpy as np')\n" + precise)
    full = await service.run(OWNER, "import numpy as np\n" + precise)
    assert (lean.stdout, lean.result) == ("False\n", "(1.235, [2.500])"), lean
    assert full.result == "(1.235, [2.500])", full


async def test_a_sessions_cells_run_in_the_full_zygotes_worker(service: SandboxService) -> None:
    await lean_streak(service)
    sid = (await service.new_session(OWNER)).session_id
    try:
        session = await service.run(OWNER, PRELOADED, session_id=sid)
        assert session.stdout == "True True\n", session
    finally:
        await service.close_session(OWNER, sid)


ZYGOTES = (
    "import os, signal, ctypes\n"
    "me = os.getuid()\n"
    "zygotes = []\n"
    "for p in os.listdir('/proc'):\n"
    "    try:\n"
    "        if int(open(f'/proc/{p}/status').read().split('\\nUid:\\t')[1].split()[0]) == me + 1:\n"
    "            zygotes.append(int(p))\n"
    "    except (OSError, IndexError, ValueError):\n"
    "        pass\n"
    "refused = []\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "for pid in zygotes:\n"
    "    for sig in (signal.SIGKILL, signal.SIGSTOP, signal.SIGTERM):\n"
    "        try:\n"
    "            os.kill(pid, sig)\n"
    "        except PermissionError:\n"
    "            refused.append(sig.name)\n"
    "    refused.append(libc.ptrace(16, pid, 0, 0) == -1)  # PTRACE_ATTACH\n"
    "import sys\n"
    "print('pandas' in sys.modules, len(zygotes), os.getppid() in zygotes, refused)\n"
)


async def test_neither_zygote_can_be_signalled_or_traced_from_a_lean_worker(service: SandboxService) -> None:
    await lean_streak(service)
    result = await service.run(OWNER, ZYGOTES)
    expected = str(["SIGKILL", "SIGSTOP", "SIGTERM", True] * 2)
    assert result.stdout == f"False 2 True {expected}\n", result
