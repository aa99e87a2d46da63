"""Notebook-grade results: displays, magics, shell escapes, image caps, output caps, files."""

from __future__ import annotations

import pytest
from _support import make_test_config, png_size

from mcp_code_exec.config.settings import Config
from mcp_code_exec.service.facade import SandboxService

pytestmark = pytest.mark.anyio
OWNER = "results"


async def test_display_calls_and_the_last_expression_are_both_returned(service: SandboxService) -> None:
    result = await service.run(
        OWNER, "from IPython.display import display\ndisplay('first')\ndisplay({'k': 1})\n40 + 2"
    )
    assert result.displays == ["'first'", "{'k': 1}"]
    assert result.result == "42"


async def test_a_rich_png_display_comes_back_as_an_image(service: SandboxService) -> None:
    code = "from PIL import Image as P\nP.new('RGB', (30, 20), 'red')"
    result = await service.run(OWNER, code)
    assert result.status == "ok"
    assert len(result.images) == 1
    assert png_size(result.images[0].data) == (30, 20)


async def test_plt_show_flushes_figures_one_image_each(service: SandboxService) -> None:
    code = "import matplotlib.pyplot as plt\nfor i in range(3):\n    plt.plot([i, i + 1])\n    plt.show()"
    result = await service.run(OWNER, code)
    assert len(result.images) == 3
    assert all(image.data.startswith(b"\x89PNG") for image in result.images)


TIGHT_SIZE = (
    "import io\nfrom PIL import Image\n"
    "buffer = io.BytesIO(); plt.gcf().savefig(buffer, format='png', bbox_inches='tight')\n"
    "print(*Image.open(buffer).size)"
)


@pytest.mark.parametrize(
    "figure",
    [
        "plt.figure(figsize=(4, 3)); plt.plot([1, 4, 9]); plt.title('inside the figure')",
        # The legend lies beyond the figure's right edge: the picture must grow to show it.
        "plt.figure(figsize=(4, 3)); plt.plot([1, 2], label='a long legend label')\n"
        "plt.legend(bbox_to_anchor=(1.05, 1), loc='upper left')",
        # The tight box is measured with each artist once (figures.tight_bbox): these cover the
        # shapes where matplotlib's own measurement takes other turns.
        "fig, axes = plt.subplots(2, 2); fig.suptitle('four'); axes[0][0].set_xlabel('a wide label ' * 6)",
        "plt.colorbar(plt.imshow([[0, 1], [1, 0]])); plt.title('colour')",
        "fig, axes = plt.subplots(1, 2); axes[1].set_in_layout(False); axes[1].set_title('left out')",
        "plt.subplot(projection='polar').plot([0, 1], [1, 2])",
        "plt.plot([1, 2]); plt.gca().twinx().plot([3, 1]); plt.figtext(0.01, 0.01, 'figure text')",
    ],
    ids=["within-the-figure", "legend-outside", "subplots", "colorbar", "axes-not-in-layout", "polar", "twin"],
)
async def test_a_figure_is_cropped_as_jupyter_crops_it(service: SandboxService, figure: str) -> None:
    result = await service.run(OWNER, f"import matplotlib.pyplot as plt\n{figure}\n{TIGHT_SIZE}")
    assert result.status == "ok", result.error
    assert len(result.images) == 1
    width, height = (int(n) for n in result.stdout.split())
    assert png_size(result.images[0].data) == (width, height)


async def test_a_session_cell_after_a_plot_still_takes_the_lean_path(service: SandboxService) -> None:
    # pyplot hooks the shell when it loads its backend; the agent loads it before forking, so a
    # plot does not push every later cell of the session onto IPython's slower run_cell.
    session = await service.new_session(OWNER)
    try:
        plotted = await service.run(
            OWNER, "import matplotlib.pyplot as plt\nplt.plot([1, 2])", session_id=session.session_id
        )
        assert len(plotted.images) == 1
        check = "from mcpx_agent.worker.shell import lean_eligible\nlean_eligible(get_ipython(), 'x = 1')"
        after = await service.run(OWNER, check, session_id=session.session_id)
        assert after.result == "True", after
    finally:
        await service.close_session(OWNER, session.session_id)


async def test_magics_and_shell_escapes_work_in_a_session(service: SandboxService) -> None:
    session = await service.new_session(OWNER)
    sid = session.session_id
    try:
        pwd = await service.run(OWNER, "%pwd", session_id=sid)
        assert pwd.result == "'/mnt/data'"
        shell = await service.run(OWNER, "!echo hello from the shell", session_id=sid)
        assert "hello from the shell" in shell.stdout
        captured = await service.run(OWNER, "files = !ls /\n'mnt' in files", session_id=sid)
        assert captured.result == "True"
        timed = await service.run(OWNER, "%time sum(range(1000))", session_id=sid)
        assert timed.result == "499500"
        # Verbose tracebacks come from a module the agent loads only when it is first needed.
        await service.run(OWNER, "%xmode Verbose", session_id=sid)
        verbose = await service.run(OWNER, "def f(divisor):\n    return 1 / divisor\nf(0)", session_id=sid)
        assert verbose.error is not None and verbose.error.type == "ZeroDivisionError"
        assert "divisor = 0" in verbose.error.traceback
    finally:
        await service.close_session(OWNER, sid)


async def test_an_image_over_the_pixel_cap_is_downscaled_and_the_original_kept_in_a_session(config: Config) -> None:
    small = make_test_config(limits={"max_image_pixels": 40_000}, pool={"size": 1, "session_spares": 0})
    async with SandboxService.start(small) as service:
        session = await service.new_session(OWNER)
        code = "import matplotlib.pyplot as plt\nplt.figure(figsize=(8, 6), dpi=100)\nplt.plot([1, 2])"
        result = await service.run(OWNER, code, session_id=session.session_id)
        image = result.images[0]
        assert image.width * image.height <= 40_000
        assert image.note is not None and "downscaled" in image.note and "original kept" in image.note
        kept = [f.path for f in result.files if f.path.startswith("images/")]
        assert len(kept) == 1
        original = await service.read_file(OWNER, session.session_id, kept[0])
        width, height = png_size(original.data)
        assert width * height > 40_000


async def test_endless_output_is_cut_with_a_marker_and_flagged(service: SandboxService) -> None:
    result = await service.run(OWNER, "import sys\nfor i in range(200000):\n    print('line', i)", timeout=30)
    assert result.status == "ok"
    assert "stdout" in result.truncated
    assert "bytes of output cut here" in result.stdout
    assert result.stdout.startswith("line 0\n")
    assert result.stdout.rstrip().endswith("line 199999")
    assert len(result.stdout.encode()) < service.config.limits.max_output_bytes + 500


async def test_stderr_and_warnings_are_captured_separately(service: SandboxService) -> None:
    result = await service.run(
        OWNER, "import sys, warnings\nprint('out')\nprint('err', file=sys.stderr)\nwarnings.warn('careful')"
    )
    assert result.stdout == "out\n"
    assert "err" in result.stderr and "careful" in result.stderr


async def test_output_that_is_not_utf8_arrives_as_text(service: SandboxService) -> None:
    result = await service.run(OWNER, "import os\nos.write(1, b'\\xff\\xfe ok \\x00\\n')")
    assert result.status == "ok"
    assert "ok" in result.stdout and "\ufffd" in result.stdout
