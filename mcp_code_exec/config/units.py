"""The unit of the sizes users write: a file's ``_mb`` keys are MiB, and every section turns them
into bytes (its ``_bytes`` properties), which is what every other layer reads. Standard library
only; the one place ``MIB`` is defined (the bench shows its figures in it)."""

from __future__ import annotations

MIB = 1 << 20
