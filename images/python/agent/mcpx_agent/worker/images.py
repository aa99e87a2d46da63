"""Keep images within the byte and pixel caps a client can afford (runs in the worker)."""

from __future__ import annotations

import io
import os
import time
from typing import Any

DEFAULT_MAX_BYTES = 1_000_000
DEFAULT_MAX_PIXELS = 2_000_000


def fit_image(blob: bytes, mime: str, options: dict[str, Any]) -> tuple[tuple[bytes, str], int, int, str]:
    """((bytes, mime), width, height, note): the image, downscaled when over a cap.

    Empty bytes when it cannot be read as an image or not brought under the caps: nothing
    unreadable is passed on, so every image that leaves the sandbox has a known size.
    """
    max_bytes = int(options.get("max_image_bytes", DEFAULT_MAX_BYTES))
    max_pixels = int(options.get("max_image_pixels", DEFAULT_MAX_PIXELS))
    try:
        from PIL import Image

        image = Image.open(io.BytesIO(blob))
        width, height = image.size
        if image.format not in ("PNG", "JPEG"):
            raise ValueError(image.format)
    except Exception:  # noqa: BLE001 - user data: anything unreadable is dropped
        return (b"", mime), 0, 0, "not a readable PNG or JPEG image"
    if len(blob) <= max_bytes and width * height <= max_pixels:
        return (blob, "image/png" if image.format == "PNG" else "image/jpeg"), width, height, ""
    scale = min(1.0, (max_pixels / float(max(1, width * height))) ** 0.5)
    try:
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
                return (data, mime), size[0], size[1], f"downscaled from {width}x{height} to {size[0]}x{size[1]}"
            scale *= 0.7
    except Exception:  # noqa: BLE001 - a decompression bomb or a broken file: dropped like the rest
        return (b"", mime), 0, 0, "could not be decoded"
    return (b"", mime), width, height, f"image of {len(blob)} bytes dropped: over the cap"


def keep_original(blob: bytes, mime: str, number: int) -> str:
    """In a session, a downscaled image's full-size original is saved next to the user's files."""
    name = f"image-{time.strftime('%Y%m%d-%H%M%S')}-{number}.{'png' if mime == 'image/png' else 'jpg'}"
    try:
        os.makedirs("/mnt/data/images", exist_ok=True)
        with open(f"/mnt/data/images/{name}", "wb") as handle:
            handle.write(blob)
    except OSError as exc:
        return f"the original could not be kept ({exc.strerror})"
    return f"original kept as /mnt/data/images/{name}"
