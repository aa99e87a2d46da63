"""The data libraries users expect: each imports in a stateless run, and they work together."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest
from _support import make_test_config, png_size

from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
OWNER = "libraries"

# Import names of the image's promised libraries (images/python/requirements.in).
LIBRARIES = [
    "numpy", "pandas", "scipy", "sklearn", "statsmodels", "matplotlib", "seaborn", "plotly",
    "kaleido", "sympy", "networkx", "PIL", "skimage", "cv2", "openpyxl", "xlrd", "xlsxwriter",
    "pyarrow", "polars", "duckdb", "bs4", "lxml", "pypdf", "docx", "reportlab", "tabulate",
    "tqdm", "joblib", "yaml",
]  # fmt: skip


@pytest.fixture(scope="module")
async def default_memory(service: SandboxService) -> AsyncIterator[SandboxService]:
    """A stateless container with the default memory limit (512 MiB). All the libraries at once take
    about 250 MiB of it: more than the suite's 256 MiB leave once the container's own processes,
    the lean interpreter among them (``[pool] lean_interpreter``), have theirs. (The shared service
    is asked for so that it is set up first, see ``test_security_leftovers.one_container``.)"""
    settings = make_test_config(pool={"size": 1, "session_spares": 0}, limits={"memory_mb": 512})
    async with SandboxService.start(settings) as started:
        await started.wait_ready()
        yield started


async def test_every_promised_library_imports_in_a_stateless_run(default_memory: SandboxService) -> None:
    code = (
        "import importlib\nbroken = {}\n"
        f"for name in {LIBRARIES!r}:\n"
        "    try:\n        importlib.import_module(name)\n"
        "    except Exception as error:\n        broken[name] = repr(error)\n"
        "broken"
    )
    result = await default_memory.run(OWNER, code, timeout=120)
    assert result.status == "ok", result.error
    assert result.result == "{}"


async def test_pandas_is_the_current_major_version(service: SandboxService) -> None:
    result = await service.run(OWNER, "import pandas, numpy\nprint(pandas.__version__[0], numpy.__version__[0])")
    assert result.stdout == "2 2\n"


async def test_a_session_reads_a_workbook_fits_a_model_and_saves_a_seaborn_chart(service: SandboxService) -> None:
    sid = (await service.new_session(OWNER)).session_id
    try:
        written = await service.run(
            OWNER,
            "import openpyxl\nbook = openpyxl.Workbook(); sheet = book.active\n"
            "sheet.append(['x', 'y'])\n"
            "for x in range(40): sheet.append([x, 3 * x + 2])\n"
            "book.save('sales.xlsx')",
            session_id=sid,
        )
        assert written.status == "ok", written.error
        fitted = await service.run(
            OWNER,
            "import pandas as pd, seaborn as sns\nfrom sklearn.linear_model import LinearRegression\n"
            "frame = pd.read_excel('sales.xlsx')\n"
            "model = LinearRegression().fit(frame[['x']], frame['y'])\n"
            "sns.regplot(data=frame, x='x', y='y').figure.savefig('fit.png')\n"
            "round(float(model.coef_[0]), 6), round(float(model.intercept_), 6)",
            session_id=sid,
            timeout=120,
        )
        assert fitted.status == "ok", fitted.error
        assert fitted.result == "(3.0, 2.0)"
        chart = await service.read_file(OWNER, sid, "fit.png")
        assert png_size(chart.data)[0] > 100
    finally:
        await service.close_session(OWNER, sid)


async def test_a_plotly_figure_comes_back_as_a_static_image(service: SandboxService) -> None:
    code = "import plotly.express as px\npx.bar(x=['a', 'b'], y=[1, 3])"
    result = await service.run(OWNER, code, timeout=120)
    assert result.status == "ok", result.error
    assert len(result.images) == 1
    assert png_size(result.images[0].data)[0] > 100
