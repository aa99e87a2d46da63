"""The agent's frames on a pipe: frames longer than PIPE_BUF from several threads (displays and
images from one, code mode's call frames from another) arrive whole, one after another."""

from __future__ import annotations

import os
import sys
import threading
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent import protocol

FRAMES_PER_THREAD = 40
PAYLOAD = 200 << 10  # several writes each: a pipe takes at most 64 KiB at a time


def test_long_frames_from_two_threads_never_interleave() -> None:
    read_end, write_end = os.pipe()
    received: list[tuple[dict[str, object], bytes]] = []
    broken: list[str] = []

    def reader() -> None:
        frames = protocol.FrameReader(read_end, max_header=1 << 16, max_payload=1 << 20)
        while not frames.eof:
            frames.fill(4096)  # a slow reader: the pipe fills, and a writer waits midway through its frame
            if broken:
                continue  # read on to the end, so the writers finish
            try:
                received.extend(frames.frames())
            except protocol.ProtocolError as exc:
                broken.append(str(exc))

    def writer(kind: str, byte: bytes) -> None:
        for index in range(FRAMES_PER_THREAD):
            protocol.send(write_end, {"kind": kind, "index": index}, byte * PAYLOAD)

    threads = [threading.Thread(target=writer, args=(kind, byte)) for kind, byte in (("call", b"c"), ("image", b"i"))]
    read = threading.Thread(target=reader)
    read.start()
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    os.close(write_end)
    read.join(timeout=60)
    os.close(read_end)
    assert broken == [] and len(received) == 2 * FRAMES_PER_THREAD, broken
    for header, payload in received:
        assert payload == (b"c" if header["kind"] == "call" else b"i") * PAYLOAD, header
