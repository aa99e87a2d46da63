"""Name lookups for the hosts a wildcard entry allows, made so that no sandbox's lookups hold up
another's.

A lookup of a name nobody answers takes seconds, and ``getaddrinfo`` cannot be interrupted. On
asyncio's default pool (a handful of threads every lookup shares) one sandbox asking for many
made-up names kept every other sandbox's lookups waiting. Here lookups run on threads of their own,
each container has at most ``PER_SANDBOX`` of them going (the others wait their turn, in that
container's queue alone), and a name that failed is answered from memory for ``FAILED_KEEP_S``.
"""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

PER_SANDBOX = 4  # lookups one container may have going at once
THREADS = 128  # enough for 32 containers at their limit; the proxy's process limit is 512
FAILED_KEEP_S = 30.0
FAILED_MAX = 4096  # names kept as failed; past it the memory starts afresh

Resolve = Callable[[str, int], list[Any]]


def system_resolve(host: str, port: int) -> list[Any]:
    return socket.getaddrinfo(host, port, type=socket.SOCK_STREAM)


class Lookups:
    def __init__(self, resolve: Resolve = system_resolve, threads: int = THREADS) -> None:
        self.resolve = resolve
        self.pool = ThreadPoolExecutor(threads, thread_name_prefix="egress-lookup")
        self.gates: dict[str | None, tuple[asyncio.Semaphore, list[int]]] = {}
        self.failed: dict[str, tuple[float, str]] = {}

    def going(self, binding: str | None) -> int:
        """How many lookups of ``binding``'s container are going or waiting (for the ping and tests)."""
        gate = self.gates.get(binding)
        return gate[1][0] if gate is not None else 0

    async def addresses(self, binding: str | None, host: str, port: int) -> list[str]:
        """The addresses ``host`` resolves to, as this host resolves it; ``socket.gaierror`` otherwise."""
        known = self.failed.get(host)
        if known is not None and known[0] > time.monotonic():
            raise socket.gaierror(socket.EAI_NONAME, known[1])
        gate, users = self.gates.setdefault(binding, (asyncio.Semaphore(PER_SANDBOX), [0]))
        users[0] += 1
        try:
            async with gate:  # held until the thread is done: a container never has more going
                loop = asyncio.get_running_loop()
                infos = await loop.run_in_executor(self.pool, self.resolve, host, port)
        except socket.gaierror as exc:
            if len(self.failed) >= FAILED_MAX:
                self.failed.clear()
            self.failed[host] = (time.monotonic() + FAILED_KEEP_S, exc.strerror or str(exc))
            raise
        finally:
            users[0] -= 1
            if not users[0]:
                self.gates.pop(binding, None)
        return [str(info[4][0]) for info in infos]
