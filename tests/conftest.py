"""Shared by both tiers: ``tests/unit`` (no Docker, seconds) and ``tests/engine`` (the real engine and image)."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def anyio_backend() -> str:
    return "asyncio"
