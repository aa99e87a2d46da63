"""The proxy's name lookups (``images/egress/egress_lookups.py``, imported as the image runs it),
with a resolver that blocks until the test lets it go: one container's lookups wait their turn in its
own queue, never holding up another's."""

from __future__ import annotations

import importlib
import socket
import sys
import threading
from pathlib import Path
from typing import Any

import anyio
import pytest

pytestmark = pytest.mark.anyio
IMAGE = Path(__file__).resolve().parents[2] / "images" / "egress"


@pytest.fixture
def anyio_backend() -> str:
    return "asyncio"  # as mitmproxy runs the addon


def lookups_module() -> Any:
    if str(IMAGE) not in sys.path:
        sys.path.insert(0, str(IMAGE))
    return importlib.import_module("egress_lookups")


class Resolver:
    """Names under ``.slow`` block until released (a name nobody answers); others answer at once."""

    def __init__(self) -> None:
        self.release = threading.Event()
        self.four_going = threading.Event()
        self.lock = threading.Lock()
        self.going = self.most = self.calls = 0

    def __call__(self, host: str, port: int) -> list[Any]:
        with self.lock:
            self.going += 1
            self.calls += 1
            self.most = max(self.most, self.going)
            if self.going >= 4:
                self.four_going.set()
        try:
            if host.endswith(".slow"):
                assert self.release.wait(30)
                raise socket.gaierror(socket.EAI_NONAME, "Name or service not known")
            return [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("192.0.2.7", port))]
        finally:
            with self.lock:
                self.going -= 1


async def test_a_containers_slow_lookups_wait_in_its_own_queue_and_never_hold_up_another() -> None:
    module = lookups_module()
    resolver = Resolver()
    lookups = module.Lookups(resolver, threads=16)
    failed: list[str] = []

    async def slow(n: int) -> None:
        with pytest.raises(socket.gaierror):
            await lookups.addresses("alice", f"{n}.slow", 80)
        failed.append(str(n))

    async with anyio.create_task_group() as group:
        for n in range(40):  # far more than the pool's threads
            group.start_soon(slow, n)
        with anyio.fail_after(10):
            assert await anyio.to_thread.run_sync(resolver.four_going.wait, 10)  # alice's lookups hang
            assert await lookups.addresses("bob", "data.example", 443) == ["192.0.2.7"]
            assert lookups.going("alice") == 40  # all still going or waiting their turn
        assert resolver.most <= module.PER_SANDBOX + 1  # alice's four, and bob's one
        resolver.release.set()
    assert len(failed) == 40 and lookups.going("alice") == 0 and lookups.gates == {}


async def test_a_name_that_failed_is_answered_from_memory_for_a_while() -> None:
    module = lookups_module()
    resolver = Resolver()
    resolver.release.set()
    lookups = module.Lookups(resolver, threads=2)
    for _ in range(3):
        with pytest.raises(socket.gaierror):
            await lookups.addresses("alice", "gone.slow", 80)
    assert resolver.calls == 1 and list(lookups.failed) == ["gone.slow"]
