"""The preloaded modules' code in one file, so the zygote's start opens one file, not 2,000.

A module imported from source costs its container a dentry and an overlayfs inode for the ``.py``,
for its ``__pycache__`` directory and for the ``.pyc``: kernel memory charged to the container, and
never shared, because every container has an overlay mount of its own. For the ~750 modules the
zygote imports from source that was about 1.5 MB of every warm container. The image build imports
what the zygote imports and writes the code of every module it took from source into one file
(``PATH``); the zygote finds those modules in it by name while it loads the libraries.

A module comes out as the normal import makes it: the same code (compiled by the same loader from
the same source), ``__file__``, ``__spec__``, and a ``SourceFileLoader`` for its loader once the
libraries are loaded. Only the files are not opened. What the bundle does not hold (extension
modules, whatever a run imports later) takes the normal path.

A bundle that may not match what is installed is not used, and the zygote imports as usual: one
written by another interpreter or with another ``sys.path``, or one that names a directory whose
mtime changed since the build (pip adding, replacing or removing a package changes it). A file
edited in place leaves its directory's mtime alone and goes unnoticed: checking every file would
cost the lookups the bundle saves. ``python3 -P -m mcpx_agent.zygote.bundle`` writes it again; the image's
Dockerfile and ``image custom`` do, and a hand-made derived image should.
"""

from __future__ import annotations

import importlib.machinery
import importlib.util
import json
import marshal
import mmap
import os
import sys
from collections.abc import Iterable
from types import CodeType
from typing import Any

PATH = "/opt/mcpx/preload.bundle"
FORMAT = b"mcpx-preload-bundle 1\n"
LOADED = 0  # modules the zygote took from the bundle; workers inherit the count (the tests read it)


class BundledLoader(importlib.machinery.SourceFileLoader):
    """Takes the code from the open bundle; becomes a plain ``SourceFileLoader`` when it closes."""

    bundle: Bundle | None = None

    def get_code(self, fullname: str) -> Any:
        bundle = BundledLoader.bundle
        code = bundle.code(fullname) if bundle is not None else None
        return code if code is not None else super().get_code(fullname)


class Bundle:
    """A finder over the bundle file, first on ``sys.meta_path`` for as long as it is entered."""

    def __init__(self, data: mmap.mmap, modules: dict[str, list[Any]], base: int) -> None:
        self.data = data
        self.modules = modules  # name: [origin, is a package, offset, size]
        self.base = base
        self.loaders: list[BundledLoader] = []

    @classmethod
    def open(cls, path: str = PATH) -> Bundle | None:
        """The bundle at ``path``, or None where there is none or it may not match (said on stderr)."""
        try:
            with open(path, "rb") as file:
                data = mmap.mmap(file.fileno(), 0, prot=mmap.PROT_READ)
        except (OSError, ValueError):  # none in this image (ValueError: an empty file)
            return None
        try:
            header, base = read_header(data)
            problem = mismatch(header)
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            problem = f"unreadable ({exc})"
        if problem:
            data.close()
            sys.stderr.write(f"mcpx_agent: the preload bundle is not used: {problem}\n")
            return None
        return cls(data, header["modules"], base)

    def find_spec(self, name: str, path: Any = None, target: Any = None) -> importlib.machinery.ModuleSpec | None:
        entry = self.modules.get(name)
        if entry is None:
            return None
        origin, is_package = entry[0], entry[1]
        directory = os.path.dirname(origin)
        if path is not None and os.path.dirname(directory if is_package else origin) not in path:
            return None  # a parent package whose __path__ was changed: let the path finder decide
        loader = BundledLoader(name, origin)
        self.loaders.append(loader)
        locations = [directory] if is_package else None
        return importlib.util.spec_from_file_location(name, origin, loader=loader, submodule_search_locations=locations)

    def code(self, name: str) -> Any:
        """The module's code, or None (the normal path then reads its files) where it does not load."""
        entry = self.modules.get(name)
        if entry is None:
            return None
        start = self.base + entry[2]
        try:
            code = marshal.loads(self.data[start : start + entry[3]])  # noqa: S302 - as trusted as the image's .pyc files
        except (EOFError, ValueError, TypeError):
            return None
        return code if isinstance(code, CodeType) else None

    def __enter__(self) -> Bundle:
        sys.meta_path.insert(0, self)
        BundledLoader.bundle = self
        return self

    def __exit__(self, *exc_info: object) -> None:
        global LOADED
        sys.meta_path.remove(self)
        BundledLoader.bundle = None
        LOADED = len(self.loaders)
        for loader in self.loaders:  # what a normal import leaves; the class swap allocates nothing
            loader.__class__ = importlib.machinery.SourceFileLoader  # type: ignore[assignment]
        self.loaders = []
        self.modules = {}
        self.data.close()


def read_header(data: mmap.mmap) -> tuple[dict[str, Any], int]:
    """The header and where the code starts; ValueError where the file is not a whole bundle."""
    if data[: len(FORMAT)] != FORMAT:
        raise ValueError("not a preload bundle")
    size_at = len(FORMAT)
    size = int.from_bytes(data[size_at : size_at + 8], "little")
    header = json.loads(data[size_at + 8 : size_at + 8 + size])
    base = size_at + 8 + size
    for entry in header["modules"].values():
        match entry:
            case [str(), bool(), int(offset), int(length)] if (
                offset >= 0 and length >= 0 and base + offset + length <= len(data)
            ):
                pass
            case _:
                raise ValueError(f"a module entry out of place: {entry!r:.80}")
    return header, base


def mismatch(header: dict[str, Any]) -> str:
    """Why the bundle may not hold what the normal import would find, or "" where it does."""
    if header["magic"] != importlib.util.MAGIC_NUMBER.hex():
        return "written by another Python"
    if header["path"] != sys.path:
        return "written with another sys.path"
    for directory, mtime in header["dirs"].items():
        try:
            if int(os.stat(directory).st_mtime) != mtime:
                return f"{directory} changed since it was written"
        except OSError:
            return f"{directory} is gone"
    return ""


def write(path: str, names: Iterable[str] | None = None) -> int:
    """Write the code of the modules named (by default every one imported from source so far) that
    were imported from source; the number written."""
    modules: dict[str, list[Any]] = {}
    dirs: dict[str, int] = {}
    blobs: list[bytes] = []
    offset = 0
    for name in sorted(sys.modules if names is None else names):
        spec = getattr(sys.modules.get(name), "__spec__", None)
        loader = getattr(spec, "loader", None)
        if spec is None or spec.name != name or type(loader) is not importlib.machinery.SourceFileLoader:
            continue
        origin = spec.origin
        is_package = spec.submodule_search_locations is not None
        blob = marshal.dumps(loader.source_to_code(loader.get_data(origin), origin))
        modules[name] = [origin, is_package, offset, len(blob)]
        blobs.append(blob)
        offset += len(blob)
        directory = os.path.dirname(origin)
        for watched in (directory, os.path.dirname(directory)) if is_package else (directory,):
            dirs[watched] = int(os.stat(watched).st_mtime)
    header = {"magic": importlib.util.MAGIC_NUMBER.hex(), "path": sys.path, "dirs": dirs, "modules": modules}
    encoded = json.dumps(header, separators=(",", ":")).encode()
    partial = f"{path}.partial"
    with open(partial, "wb") as file:
        file.write(FORMAT + len(encoded).to_bytes(8, "little") + encoded)
        file.writelines(blobs)
    os.replace(partial, path)
    return len(modules)


def main() -> int:
    """Import what the zygote imports, then write the bundle (at image build time)."""
    from .preload import load_libraries

    load_libraries()
    path = sys.argv[1] if len(sys.argv) > 1 else PATH
    count = write(path)
    sys.stderr.write(f"mcpx_agent: {count} modules in {path}\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
