"""Keep images within the byte and pixel caps a client can afford."""

from __future__ import annotations

import io
from typing import Any

DEFAULT_MAX_BYTES = 1_000_000
DEFAULT_MAX_PIXELS = 2_000_000


def fit_image(blob: bytes, mime: str, options: dict[str, Any]) -> tuple[tuple[bytes, str], int, int, str]:
    """Return ((bytes, mime), width, height, note); downscale when over a cap."""
    max_bytes = int(options.get("max_image_bytes", DEFAULT_MAX_BYTES))
    max_pixels = int(options.get("max_image_pixels", DEFAULT_MAX_PIXELS))
    try:
        from PIL import Image
    except ImportError:
        return (blob, mime), 0, 0, ""
    try:
        image = Image.open(io.BytesIO(blob))
        width, height = image.size
    except Exception:  # noqa: BLE001 - not an image we can read: pass it through unchanged
        return (blob, mime), 0, 0, ""
    if len(blob) <= max_bytes and width * height <= max_pixels:
        return (blob, mime), width, height, ""
    scale = min(1.0, (max_pixels / float(max(1, width * height))) ** 0.5)
    out_mime = mime
    data = blob
    for _ in range(6):
        size = (max(1, int(width * scale)), max(1, int(height * scale)))
        resized = image.convert("RGBA" if mime == "image/png" else "RGB").resize(size)
        buffer = io.BytesIO()
        if mime == "image/png":
            resized.save(buffer, format="PNG", optimize=True)
        else:
            resized.save(buffer, format="JPEG", quality=85)
        data = buffer.getvalue()
        if len(data) <= max_bytes:
            note = f"downscaled from {width}x{height} to {size[0]}x{size[1]}"
            return (data, out_mime), size[0], size[1], note
        scale *= 0.7
    return (b"", out_mime), width, height, f"image of {len(blob)} bytes dropped: over the cap"
