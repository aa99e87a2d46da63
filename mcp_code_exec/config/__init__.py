"""Configuration, below every other layer: ``settings`` (``Config`` and ``load_config``: the file,
the environment, the defaults), ``sections`` and ``faces`` (a model per table of the file),
``units`` (``MIB``, the unit of the file's ``_mb`` keys), ``moved`` (keys older files spell another
way), ``cluster`` (the ``[cluster]`` section), ``mounts`` (host directories, checked as they load)
and ``greeting`` (what the server says of its configuration at the handshake).

``Config`` and ``load_config`` load on first use: ``mounts`` and ``greeting`` are standard library
only, and the stdio front imports them without paying for pydantic.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .settings import Config, load_config

__all__ = ["Config", "load_config"]


def __getattr__(name: str) -> Any:
    if name not in __all__:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    return getattr(importlib.import_module(".settings", __name__), name)
