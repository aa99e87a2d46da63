"""config.example.toml documents every option with its default, and cannot drift from Config."""

from __future__ import annotations

import re
import tomllib
from pathlib import Path
from typing import Any, get_args, get_origin

import pytest
from pydantic import BaseModel

from mcp_code_exec.config.oauth import OAuthSettings
from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.errors import ConfigError

EXAMPLE = Path(__file__).resolve().parents[2] / "config.example.toml"


def sections(text: str) -> dict[str, set[str]]:
    """Keys per section, commented-out ones included (``# key = value`` lines)."""
    found: dict[str, set[str]] = {"": set()}
    current = ""
    for line in text.splitlines():
        header = re.match(r"^#? ?\[([\w.]+)\]\s*$", line) or re.match(r"^#? ?\[\[([\w.]+)\]\]\s*$", line)
        if header:
            current = header.group(1)
            found.setdefault(current, set())
            parent, dot, key = current.rpartition(".")
            if dot and "[[" in line:  # an array of tables of a section ([[egress.secrets]]) is a key of it
                found.setdefault(parent, set()).add(key)
            continue
        key = re.match(r"^#?\s?([a-z_][a-z0-9_]*) = ", line)
        if key:
            found[current].add(key.group(1))
    return found


def table_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a table in a section: a plain one (``[quotas.default]``) or an optional one
    (``OAuthSettings | None``, documented commented out); else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    found = [arg for arg in get_args(annotation) if isinstance(arg, type) and issubclass(arg, BaseModel)]
    return found[0] if found and type(None) in get_args(annotation) else None


def test_an_optional_table_documents_its_defaults_commented_out() -> None:
    """``[http.oauth]``, uncommented: it loads, and every value it shows but the examples of its
    required keys (and of the optional ones that default to unset) is the default."""
    text = EXAMPLE.read_text()
    block = text[text.index("# [http.oauth]") :].split("\n\n")[0]
    uncommented = "\n".join(line[2:] for line in block.splitlines() if line.startswith("# ") and " = " in line)
    loaded = tomllib.loads(uncommented)
    settings = OAuthSettings.model_validate(loaded)
    examples = {"issuer", "resource", "audience", "metrics_scope", "introspection_client_id"}
    examples |= {"introspection_client_secret"}
    defaults = OAuthSettings(issuer=settings.issuer, resource=settings.resource)
    for key in set(loaded) - examples:
        assert getattr(settings, key) == getattr(defaults, key), key
    assert set(loaded) == set(OAuthSettings.model_fields)


def test_the_example_config_loads_and_equals_the_defaults() -> None:
    loaded = load_config(EXAMPLE, environ={})
    assert loaded == Config()
    assert loaded.model_dump() == Config().model_dump()


def test_the_example_config_names_every_option_in_its_section() -> None:
    documented = sections(EXAMPLE.read_text())
    top_level = set()
    for name, field in Config.model_fields.items():
        annotation = field.annotation
        if get_origin(annotation) is list:  # an array of tables ([[mounts]]), documented commented out
            (annotation,) = get_args(annotation)
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            tables = {key for key, inner in annotation.model_fields.items() if table_model(inner.annotation)}
            for table in tables:  # a table of its own ([quotas.default], [http.oauth])
                inner = table_model(annotation.model_fields[table].annotation)
                assert inner is not None and set(inner.model_fields) == documented.get(f"{name}.{table}"), table
            assert set(annotation.model_fields) - {"tokens"} - tables <= documented.get(name, set()), name
            assert documented[name] - set(annotation.model_fields) == set(), f"unknown keys in [{name}]"
            for key, member in annotation.model_fields.items():  # an array of tables inside it: [[name.key]]
                (item,) = get_args(member.annotation) if get_origin(member.annotation) is list else (None,)
                if f"{name}.{key}" in documented and isinstance(item, type) and issubclass(item, BaseModel):
                    assert documented[f"{name}.{key}"] == set(item.model_fields), f"[[{name}.{key}]]"
        else:
            top_level.add(name)
    assert top_level == documented[""]
    assert "http.tokens" in documented  # a table of its own


def test_every_option_has_an_explanation_line() -> None:
    lines = EXAMPLE.read_text().splitlines()
    for number, line in enumerate(lines):
        if re.match(r"^#?\s?[a-z_]+ = ", line) and not line.startswith("# alice"):
            assert lines[number - 1].startswith("#"), f"no explanation above line {number + 1}: {line}"


def test_the_old_sections_load_under_runs_with_a_warning_naming_each_new_key(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "old.toml"
    path.write_text("[stateless_files]\nkeep_s = 7.0\nmax_file_mb = 3\n\n[results]\nresource_links = true\n")
    loaded = load_config(path, environ={})
    assert (loaded.runs.files_keep_s, loaded.runs.files_max_file_mb, loaded.runs.resource_links) == (7.0, 3, True)
    assert loaded.runs.files_max_total_mb == Config().runs.files_max_total_mb
    captured = capsys.readouterr()
    assert captured.out == ""
    lines = captured.err.splitlines()
    assert len(lines) == 3
    assert "[stateless_files] keep_s is deprecated: write runs.files_keep_s" in lines[0]
    assert "[stateless_files] max_file_mb is deprecated: write runs.files_max_file_mb" in lines[1]
    assert "[results] resource_links is deprecated: write runs.resource_links" in lines[2]


def test_a_key_under_its_old_and_its_new_name_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "both.toml"
    path.write_text("[runs]\nfiles_keep_s = 5.0\n\n[stateless_files]\nkeep_s = 7.0\n")
    with pytest.raises(ConfigError, match=r"stateless_files\.keep_s and runs\.files_keep_s are one setting"):
        load_config(path, environ={})


def test_an_old_section_with_a_key_it_never_had_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "typo.toml"
    path.write_text("[results]\nresource_link = true\n")
    with pytest.raises(ConfigError, match=r"results\.resource_link: unknown key"):
        load_config(path, environ={})


def test_the_new_keys_load_without_a_word(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "new.toml"
    path.write_text("[runs]\nfiles_keep_s = 5.0\nresource_links = true\n")
    loaded = load_config(path, environ={})
    assert (loaded.runs.files_keep_s, loaded.runs.resource_links) == (5.0, True)
    assert capsys.readouterr().err == ""
