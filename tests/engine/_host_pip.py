"""A package index on loopback for the host-pip tests (issue 23): wheels made here, and names whose
index page never comes (a resolution that hangs), so that tests can hold the host's pip mid-run.

Everything else 404s at once, so pip goes on to the machine's own index (its extra-index-url and
find-links stay as configured)."""

from __future__ import annotations

import base64
import hashlib
import io
import os
import threading
import time
import zipfile
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

SLOW_PREFIX = "slow-"  # /simple/slow-*/ answers after HANG_S (or when the index stops)
HANG_S = 120.0
PACE_BYTES, PACE_S = 32 * 1024, 0.02  # wheels are served at about 1.6 MB/s


def make_wheel(name: str, version: str, payload_bytes: int) -> tuple[str, bytes]:
    """A pure-Python wheel of ``name`` with ``payload_bytes`` of random data (incompressible)."""
    module = name.replace("-", "_")
    files = {
        f"{module}/__init__.py": f"VALUE = {version!r}\n".encode(),
        f"{module}/blob.bin": os.urandom(payload_bytes),
        f"{module}-{version}.dist-info/METADATA": f"Metadata-Version: 2.1\nName: {name}\nVersion: {version}\n".encode(),
        f"{module}-{version}.dist-info/WHEEL": b"Wheel-Version: 1.0\nGenerator: tests\nRoot-Is-Purelib: true\n"
        b"Tag: py3-none-any\n",
    }
    record = f"{module}-{version}.dist-info/RECORD"
    lines = []
    for path, data in files.items():
        digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
        lines.append(f"{path},sha256={digest},{len(data)}")
    files[record] = ("\n".join([*lines, f"{record},,"]) + "\n").encode()
    buffer = io.BytesIO()
    with zipfile.ZipFile(buffer, "w", zipfile.ZIP_STORED) as archive:
        for path, data in files.items():
            archive.writestr(path, data)
    return f"{module}-{version}-py3-none-any.whl", buffer.getvalue()


@dataclass
class LoopbackIndex:
    url: str = ""
    wheels: dict[str, tuple[str, bytes]] = field(default_factory=dict)  # project -> (file name, bytes)
    hanging: list[str] = field(default_factory=list)  # the slow names asked for, in order
    stop: threading.Event = field(default_factory=threading.Event)

    def add(self, name: str, version: str, payload_bytes: int) -> int:
        """Publish a made wheel; its size."""
        self.wheels[name] = make_wheel(name, version, payload_bytes)
        return len(self.wheels[name][1])


@contextmanager
def loopback_index() -> Iterator[LoopbackIndex]:
    index = LoopbackIndex()

    class Handler(BaseHTTPRequestHandler):
        def log_message(self, *args: object) -> None:
            pass

        def do_GET(self) -> None:
            parts = [part for part in self.path.split("?")[0].split("/") if part]
            if parts[:1] == ["simple"] and len(parts) == 2:
                self.page(parts[1])
            elif parts[:1] == ["files"] and len(parts) == 2:
                found = [data for file, data in index.wheels.values() if file == parts[1]]
                self.answer(200, found[0], "application/octet-stream", paced=True) if found else self.answer(404, b"")
            else:
                self.answer(404, b"")

        def page(self, name: str) -> None:
            if name.startswith(SLOW_PREFIX):
                index.hanging.append(name)
                index.stop.wait(HANG_S)  # the resolution hangs here until pip is killed
                self.answer(404, b"")
            elif name in index.wheels:
                file, data = index.wheels[name]
                digest = hashlib.sha256(data).hexdigest()
                html = f'<html><body><a href="../../files/{file}#sha256={digest}">{file}</a></body></html>'
                self.answer(200, html.encode(), "text/html")
            else:
                self.answer(404, b"")

        def answer(self, status: int, body: bytes, kind: str = "text/plain", *, paced: bool = False) -> None:
            try:
                self.send_response(status)
                self.send_header("Content-Type", kind)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                step = PACE_BYTES if paced else len(body) or 1
                for start in range(0, len(body), step):  # a wheel comes as from a remote index, not at once
                    self.wfile.write(body[start : start + step])
                    if paced:
                        time.sleep(PACE_S)
            except OSError:
                pass  # pip went away (it was killed)

    server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
    server.daemon_threads = True
    index.url = f"http://127.0.0.1:{server.server_address[1]}/simple"
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield index
    finally:
        index.stop.set()
        server.shutdown()
        server.server_close()


def alive(pid: int) -> bool:
    """The process exists (a zombie not yet reaped counts: it must be reaped too)."""
    return Path(f"/proc/{pid}").exists()
