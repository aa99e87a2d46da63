"""Open matplotlib figures as PNG images, cropped as Jupyter's inline backend crops them.

Jupyter saves a figure with ``bbox_inches="tight"``: the picture is cut to what the artists
cover, plus a margin. matplotlib does that by drawing the figure twice (once to measure, once to
print) and laying the text out a third time in between, which is most of a plot cell's cost.
``render_png`` draws once, at the figure's own size, measures the tight box on that drawing and
cuts it out of the pixels already there. Only when some artist reaches beyond the figure's edge
(a legend placed outside the axes, say), so the pixels do not hold it, or when the user changed
how figures are saved, does matplotlib's own path run.
"""

from __future__ import annotations

import io
import sys
from typing import Any

from .sink import SINK

# zlib level 1: about 10 ms less per figure, ~25% more bytes; a model's image cost is in pixels, not bytes.
PNG_OPTIONS = {"compress_level": 1}


def flush_figures() -> None:
    """Send every open matplotlib figure as a PNG and close it (what Jupyter's inline backend does)."""
    pyplot = sys.modules.get("matplotlib.pyplot")
    if pyplot is None:
        return
    for number in list(pyplot.get_fignums()):
        figure = pyplot.figure(number)
        try:
            png = render_png(figure)
        except Exception as exc:  # noqa: BLE001 - a broken figure must not lose the others
            SINK.send_display(f"[figure {number} could not be rendered: {exc}]")
        else:
            SINK.image(png, "image/png")
    pyplot.close("all")


def render_png(figure: Any) -> bytes:
    """The figure as ``savefig(format="png", bbox_inches="tight")`` would give it, drawn once."""
    return _render_cropped(figure) or _render_tight(figure)


def _render_tight(figure: Any) -> bytes:
    buffer = io.BytesIO()
    figure.savefig(buffer, format="png", bbox_inches="tight", pil_kwargs=PNG_OPTIONS)
    return buffer.getvalue()


def _render_cropped(figure: Any) -> bytes | None:
    """The tight crop of a single drawing, or None where that would not match savefig's result."""
    import matplotlib
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.colors import to_rgba
    from PIL import Image

    rc = matplotlib.rcParams
    canvas = figure.canvas
    saved_as_drawn = (
        rc["savefig.dpi"] == "figure"
        and rc["savefig.facecolor"] == "auto"
        and rc["savefig.edgecolor"] == "auto"
        and not rc["savefig.transparent"]
    )
    if not saved_as_drawn or type(canvas) is not FigureCanvasAgg:
        return None
    canvas.draw()
    tight = figure.get_tightbbox(canvas.get_renderer())  # matplotlib >= 3.8 measures each Axes once
    dpi = figure.dpi
    width, height = canvas.get_width_height()
    if tight is None or not (tight.width > 0 and tight.height > 0):
        return None
    # The box in pixels, from the top left as PIL counts (matplotlib counts from the bottom).
    left, right = tight.x0 * dpi, tight.x1 * dpi
    top, bottom = height - tight.y1 * dpi, height - tight.y0 * dpi
    if left < 0 or top < 0 or right > width or bottom > height:
        return None  # something is drawn outside the figure: only matplotlib's own path shows it
    pad = float(rc["savefig.pad_inches"]) * dpi
    # savefig's size: the padded box, truncated to whole pixels; its origin: the box's lower left.
    size = (int(right - left + 2 * pad), int(bottom - top + 2 * pad))
    x0, y0 = round(left - pad), round(bottom + pad) - size[1]
    box = (x0, y0, x0 + size[0], y0 + size[1])
    drawn = Image.frombuffer("RGBA", (width, height), canvas.buffer_rgba(), "raw", "RGBA", 0, 1)
    # Where the margin runs past the figure's edge, savefig fills it with the figure's face colour.
    face = tuple(round(channel * 255) for channel in to_rgba(figure.get_facecolor()))
    picture = Image.new("RGBA", size, face)
    inside = (max(box[0], 0), max(box[1], 0), min(box[2], width), min(box[3], height))
    picture.paste(drawn.crop(inside), (inside[0] - box[0], inside[1] - box[1]))
    buffer = io.BytesIO()
    picture.save(buffer, format="PNG", **PNG_OPTIONS)
    return buffer.getvalue()
