"""What a cell's pip lines ask for, read on the host before it runs, and the policy on it; the
sandbox's shell sends the same lines to its own %pip (the two halves are held together here)."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest

from mcp_code_exec.config.sections import PackageSettings
from mcp_code_exec.errors import PackageError
from mcp_code_exec.service.packages.installs import WHEELHOUSE, missing
from mcp_code_exec.service.packages.requirements import PIP_LINE, SHELL_SYNTAX, check_denied, check_requested, prescan

sys.path.insert(0, str(Path(__file__).resolve().parents[2] / "images" / "python" / "agent"))
from mcpx_agent.supervisor import files as agent_files
from mcpx_agent.supervisor import tree as agent_tree
from mcpx_agent.worker import packages as agent_packages


def test_the_magic_the_shell_escapes_and_a_bare_line_all_ask_for_packages() -> None:
    cell = "\n".join(
        [
            "import os",
            "%pip install humanize",
            "!pip install -q 'toolz>=0.12' termcolor",
            "!pip3 install emoji==2.*",
            "!python -m pip install tomli-w",
            "  !{sys.executable} -m pip install Foo_Bar[extra]",
            "pip install --upgrade six  # a comment",
            "pip3 install \"attrs; python_version >= '3.8'\"",
        ]
    )
    request = prescan(cell)
    assert request is not None
    assert request.requirements == (
        "humanize",
        "toolz>=0.12",
        "termcolor",
        "emoji==2.*",
        "tomli-w",
        "Foo_Bar[extra]",
        "six",
        "attrs; python_version >= '3.8'",
    )
    assert request.names == ("humanize", "toolz", "termcolor", "emoji", "tomli-w", "foo-bar", "six", "attrs")
    assert not request.pre


def test_cells_without_an_install_ask_for_nothing() -> None:
    for cell in (
        "print(1)",
        "import pip",
        "pip = 3\nprint(pip)",
        "%pip list",
        "!pip show numpy",
        "# pip install humanize",
        "x = 'pip install humanize'",
        's = """\npip install humanize\n%pip install toolz\n"""',
        "t = 'it\\'s' + '''\n!pip install humanize\n'''",
    ):
        assert prescan(cell) is None, cell


def test_a_line_after_a_closed_triple_quoted_string_is_read_again() -> None:
    request = prescan('doc = """\npip install no\n"""\n%pip install yes')
    assert request is not None and request.requirements == ("yes",)


def test_shell_syntax_ends_the_requirements_and_packages_come_along_once() -> None:
    request = prescan("!pip install -q humanize > /dev/null 2>&1\n%pip install humanize | tail -1", ["humanize"])
    assert request is not None and request.requirements == ("humanize",)


def test_pre_releases_and_harmless_options_are_accepted() -> None:
    request = prescan("%pip install -qU --pre --upgrade-strategy eager --no-deps humanize")
    assert request is not None and request.pre and request.requirements == ("humanize",)


@pytest.mark.parametrize(
    ("cell", "says"),
    [
        ("%pip install -e .", "editable installs build from source"),
        ("%pip install -r requirements.txt", "files are not read before the run"),
        ("%pip install --index-url https://example.org/simple humanize", "server's own index only"),
        ("%pip install --extra-index-url=https://example.org humanize", "server's own index only"),
        ("%pip install --target /tmp/x humanize", "session's own site directory"),
        ("%pip install --frobnicate humanize", "`pip install --frobnicate` is not supported"),
        ("%pip install https://example.org/x-1.0-py3-none-any.whl", "URLs are not supported"),
        ("%pip install git+https://github.com/a/b", "URLs are not supported"),
        ("%pip install 'x @ https://example.org/x.whl'", "URLs are not supported"),
        ("%pip install ./pkg", "files or paths are not supported"),
        ("%pip install pkg-1.0.tar.gz", "files or paths are not supported"),
        ("%pip install $name", "variables are not expanded"),
        ("!pip install {name}", "variables are not expanded"),
        ("%pip install", "names no package"),
        ("%pip install 'humanize >>> 3'", "not a requirement pip understands"),
        ("%pip install 'unclosed", "cannot read this pip line"),
    ],
)
def test_what_is_not_served_is_refused_with_a_sentence(cell: str, says: str) -> None:
    with pytest.raises(PackageError, match=says):
        prescan(cell)


def test_the_packages_argument_is_checked_like_a_pip_line() -> None:
    request = prescan("print(1)", ["humanize==4.*"])
    assert request is not None and request.names == ("humanize",)
    with pytest.raises(PackageError, match="URLs are not supported"):
        prescan("print(1)", ["https://example.org/x.whl"])


def test_too_many_packages_in_one_run_are_refused() -> None:
    with pytest.raises(PackageError, match="at most 50"):
        prescan("%pip install " + " ".join(f"p{i}" for i in range(51)))


def test_installs_can_be_turned_off() -> None:
    with pytest.raises(PackageError, match="package installs are disabled"):
        check_requested(["humanize"], PackageSettings(enabled=False))


def test_an_allow_list_admits_only_its_names_and_globs() -> None:
    settings = PackageSettings(allow=["humanize", "types-*"])
    check_requested(["humanize", "types-requests"], settings)
    with pytest.raises(PackageError, match=r"toolz is not among the packages this server installs"):
        check_requested(["humanize", "toolz"], settings)


def test_a_denied_package_is_refused_when_asked_for_and_when_pulled_in() -> None:
    settings = PackageSettings(deny=["Emoji", "evil_*"])
    with pytest.raises(PackageError, match=r"emoji is denied by this server's policy"):
        check_requested(["humanize", "emoji"], settings)
    with pytest.raises(PackageError, match=r"evil-helper \(a dependency of nice\) is denied"):
        check_denied(["nice", "evil-helper"], settings, wanted_by="nice")


def test_no_such_package_and_no_wheel_for_the_sandbox_are_told_apart() -> None:
    assert missing("nope", "x86_64", None) == "no such package on the server's index: nope (check the name)"
    said = missing("Only_Source>=1", "x86_64", ["2.0", "1.0"])
    assert "no wheel of Only_Source>=1 for the sandbox (CPython 3.11, Linux x86_64)" in said
    assert "only-source (2.0, 1.0)" in said and "never built here" in said


# -- the agent's half -----------------------------------------------------------------------------
CORPUS = [
    "%pip install humanize",
    "!pip install humanize",
    "! pip3 install humanize",
    "!python3 -m pip install humanize",
    "!{sys.executable} -m pip install humanize",
    "pip install humanize",
    "    pip3 install humanize",
    "pip = 3",
    "pipx install humanize",
    "!pipx install humanize",
    "!ls",
    "import pip",
]


@pytest.mark.parametrize("line", CORPUS)
def test_the_host_reads_exactly_the_lines_the_sandbox_sends_to_its_pip(line: str) -> None:
    host = PIP_LINE.match(line) is not None and "install" in line
    stripped = line.lstrip()
    agent = stripped.startswith("%pip ") or agent_packages.COMMAND.match(stripped) is not None
    assert host == agent, line


def test_both_halves_name_the_same_hidden_directories() -> None:
    assert f"{agent_files.ROOT}/{WHEELHOUSE}" == agent_packages.WHEELHOUSE
    assert f"{agent_files.ROOT}/.packages" == agent_packages.USER_BASE
    assert {WHEELHOUSE, ".packages", ".mcpx"} == set(agent_tree.HIDDEN)
    assert agent_packages.SHELL_SYNTAX.pattern == SHELL_SYNTAX.pattern


def test_the_shell_turns_escapes_and_bare_lines_into_our_magic() -> None:
    pytest.importorskip("IPython")
    from IPython.core.inputtransformer2 import TransformerManager

    manager = TransformerManager()
    manager.token_transformers.insert(0, agent_packages.transformer())
    cell = "x = '''\npip install no\n'''\n!pip install -q yes > /dev/null\nif x:\n    pip install also\n!ls"
    assert manager.transform_cell(cell) == (
        "x = '''\npip install no\n'''\n"
        "get_ipython().run_line_magic('pip', 'install -q yes > /dev/null')\n"
        "if x:\n    get_ipython().run_line_magic('pip', 'install also')\n"
        "get_ipython().system('ls')\n"
    )


def test_the_sandbox_explains_a_package_the_host_did_not_fetch() -> None:
    said = agent_packages.explain(["ERROR: Could not find a version", "ERROR: No matching distribution found for x"])
    assert said.startswith("No matching distribution found for x: the server fetches packages before a cell runs")


def test_a_wheel_is_unpacked_into_the_site_directory_with_its_data_moved_up(tmp_path: Path) -> None:
    import zipfile

    house, site = tmp_path / "house", tmp_path / "site"
    house.mkdir()
    with zipfile.ZipFile(house / "demo-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("demo/__init__.py", "X = 1\n")
        wheel.writestr("demo-1.0.dist-info/METADATA", "Name: demo\nVersion: 1.0\n")
        wheel.writestr("demo-1.0.data/platlib/demo_native.py", "Y = 2\n")
        wheel.writestr("demo-1.0.data/scripts/demo-cli", "#!python\n")
    agent_packages.unpack(str(house), str(site))
    found = sorted(str(path.relative_to(site)) for path in site.rglob("*") if path.is_file())
    assert found == ["demo-1.0.dist-info/METADATA", "demo/__init__.py", "demo_native.py"]
    with zipfile.ZipFile(house / "evil-1.0-py3-none-any.whl", "w") as wheel:
        wheel.writestr("../outside.py", "")
    with pytest.raises(ValueError, match="outside its directory"):
        agent_packages.unpack(str(house), str(site))
    assert not (tmp_path / "outside.py").exists()
