"""The preload bundle: modules come out of it as the normal import makes them, and a bundle that
may not match what is installed is not used."""

from __future__ import annotations

import importlib
import importlib.machinery
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent.zygote import bundle


@pytest.fixture
def package(tmp_path: Path) -> Iterator[Path]:
    """``bundled_pkg`` (a package and a submodule) on sys.path, imported once, then forgotten."""
    root = tmp_path / "site"
    (root / "bundled_pkg").mkdir(parents=True)
    (root / "bundled_pkg" / "__init__.py").write_text('"""The package."""\nVALUE = 1\n')
    (root / "bundled_pkg" / "sub.py").write_text("def answer():\n    return 2\n")
    sys.path.insert(0, str(root))
    # By a plain SourceFileLoader, as in the image: what another test module imports may hook the
    # path finder in this process (beartype's import hook, loaded with pydantic-ai's, does).
    for name, path, locations in (
        ("bundled_pkg", root / "bundled_pkg" / "__init__.py", [str(root / "bundled_pkg")]),
        ("bundled_pkg.sub", root / "bundled_pkg" / "sub.py", None),
    ):
        spec = importlib.util.spec_from_file_location(name, path, submodule_search_locations=locations)
        assert spec is not None and spec.loader is not None
        sys.modules[name] = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(sys.modules[name])
    try:
        yield root
    finally:
        sys.path.remove(str(root))
        for name in ("bundled_pkg", "bundled_pkg.sub"):
            sys.modules.pop(name, None)


def forget() -> None:
    for name in ("bundled_pkg.sub", "bundled_pkg"):
        del sys.modules[name]


def test_modules_come_from_the_bundle_and_then_look_as_a_normal_import_leaves_them(package: Path) -> None:
    # Beside the watched directories, as in the image: written into one, it would change its mtime
    # whenever the second turned between the fixture's files and the bundle (CI met that once).
    path = str(package.parent / "preload.bundle")
    assert bundle.write(path, ["bundled_pkg", "bundled_pkg.sub", "sys"]) == 2  # sys is built in
    forget()
    # Changed in place (its directory's mtime stays): only code from the bundle still answers 2.
    (package / "bundled_pkg" / "sub.py").write_text("def answer():\n    return 3\n")
    opened = bundle.Bundle.open(path)
    assert opened is not None
    with opened:
        sub = importlib.import_module("bundled_pkg.sub")
        assert sub.answer() == 2
    assert bundle.LOADED == 2
    package_module = sys.modules["bundled_pkg"]
    assert package_module.VALUE == 1 and package_module.__doc__ == "The package."
    assert package_module.__file__ == str(package / "bundled_pkg" / "__init__.py")
    assert package_module.__path__ == [str(package / "bundled_pkg")]
    assert package_module.__spec__ is not None and package_module.__spec__.cached is not None
    for module in (package_module, sub):
        assert type(module.__loader__) is importlib.machinery.SourceFileLoader
    assert bundle.Bundle not in map(type, sys.meta_path)
    assert importlib.reload(sub).answer() == 3  # closed: the normal path again


def test_a_bundle_is_not_used_once_a_directory_it_names_has_changed(
    package: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = str(package.parent / "preload.bundle")
    bundle.write(path, ["bundled_pkg", "bundled_pkg.sub"])
    directory = package / "bundled_pkg"
    later = directory.stat().st_mtime + 10
    os.utime(directory, (later, later))  # what pip adding or replacing a file there does
    assert bundle.Bundle.open(path) is None
    assert f"{directory} changed" in capsys.readouterr().err


def test_a_bundle_written_with_another_sys_path_is_not_used(package: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = str(package.parent / "preload.bundle")
    bundle.write(path, ["bundled_pkg"])
    sys.path.append("/elsewhere")
    try:
        assert bundle.Bundle.open(path) is None
    finally:
        sys.path.remove("/elsewhere")
    assert "another sys.path" in capsys.readouterr().err


def test_no_bundle_or_a_file_that_is_not_one_leaves_the_imports_as_they_are(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    assert bundle.Bundle.open(str(tmp_path / "missing")) is None
    assert capsys.readouterr().err == ""  # an image without a bundle: nothing to say
    (tmp_path / "junk").write_bytes(b"not a bundle at all")
    assert bundle.Bundle.open(str(tmp_path / "junk")) is None
    assert "unreadable" in capsys.readouterr().err


def test_a_submodule_under_a_parent_path_that_does_not_hold_it_is_left_to_the_path_finder(package: Path) -> None:
    path = str(package.parent / "preload.bundle")
    bundle.write(path, ["bundled_pkg", "bundled_pkg.sub"])
    opened = bundle.Bundle.open(path)
    assert opened is not None
    with opened:
        assert opened.find_spec("bundled_pkg.sub", ["/somewhere/else"]) is None
        spec = opened.find_spec("bundled_pkg.sub", [str(package / "bundled_pkg")])
        assert spec is not None and spec.origin == str(package / "bundled_pkg" / "sub.py")


def test_a_cut_bundle_is_not_used_and_code_that_does_not_load_is_read_from_its_files(
    package: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = package.parent / "preload.bundle"
    bundle.write(str(path), ["bundled_pkg", "bundled_pkg.sub"])
    whole = path.read_bytes()
    path.write_bytes(whole[:-10])  # the last module's code runs past the end
    assert bundle.Bundle.open(str(path)) is None
    assert "out of place" in capsys.readouterr().err
    path.write_bytes(whole[:-10] + b"\xff" * 10)  # whole, but its code does not unmarshal
    forget()
    opened = bundle.Bundle.open(str(path))
    assert opened is not None
    with opened:
        assert opened.code("bundled_pkg.sub") is None
        assert importlib.import_module("bundled_pkg.sub").answer() == 2  # from its own files
