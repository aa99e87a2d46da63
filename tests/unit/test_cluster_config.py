"""The [cluster] section: engine URLs are checked when the configuration is loaded."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest

from mcp_code_exec.config.settings import Config, load_config
from mcp_code_exec.errors import ConfigError


def cluster(engines: list[Any], **more: Any) -> Config:
    return load_config(environ={}, overrides={"cluster": {"engines": engines}, **more})


def test_no_engines_is_the_one_engine_found_as_before() -> None:
    assert Config().cluster.engines == []


def test_engines_are_urls_or_tables_and_are_named_in_order() -> None:
    loaded = cluster(["unix:///var/run/docker.sock", {"url": "ssh://deploy@host2:2222/", "capacity": 2}])
    first, second = loaded.cluster.engines
    assert (first.name, first.capacity, first.local) == ("engine-1", 1.0, True)
    assert (second.name, second.url, second.capacity, second.local) == ("engine-2", "ssh://deploy@host2:2222", 2, False)


@pytest.mark.parametrize(
    ("url", "reason"),
    [
        ("http://host2:2375", "starts with unix://, ssh:// or tcp://"),
        ("unix://var/run/docker.sock", "absolute socket path"),
        ("ssh://", "no host name"),
        ("tcp://host2:2376/var/run", "has no path"),
        ("tcp://host2", "needs a port"),
        ("tcp://host2:99999", "not a URL"),
        ("tcp://host2:2376", "needs TLS"),
        ("unix:///run/docker.sock?x=1", "no query"),
    ],
)
def test_a_bad_engine_url_is_refused_with_the_reason(url: str, reason: str) -> None:
    with pytest.raises(ConfigError, match=r"cluster\.engines\[0\].*" + reason):
        cluster([url])


def test_tcp_takes_tls_files_and_only_tcp_does(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match=r"lacks ca\.pem, cert\.pem, key\.pem"):
        cluster([{"url": "tcp://host2:2376", "cert_path": str(tmp_path)}])
    for name in ("ca.pem", "cert.pem", "key.pem"):
        (tmp_path / name).write_text("x")
    (engine,) = cluster([{"url": "tcp://host2:2376", "cert_path": str(tmp_path)}]).cluster.engines
    assert engine.cert_path == tmp_path.resolve()
    with pytest.raises(ConfigError, match="for tcp:// engines only"):
        cluster([{"url": "ssh://host2", "cert_path": str(tmp_path)}])


def test_the_same_engine_twice_or_two_names_alike_are_refused() -> None:
    with pytest.raises(ConfigError, match="listed twice"):
        cluster(["ssh://host2", "ssh://host2/"])
    with pytest.raises(ConfigError, match="two engines are named 'a'"):
        cluster([{"url": "ssh://host2", "name": "a"}, {"url": "ssh://host3", "name": "a"}])
    with pytest.raises(ConfigError, match="an engine name is"):
        cluster([{"url": "ssh://host2", "name": "Not Fine"}])


def test_capacity_is_a_positive_weight() -> None:
    with pytest.raises(ConfigError, match=r"capacity: Input should be greater than 0"):
        cluster([{"url": "ssh://host2", "capacity": 0}])


def test_docker_host_and_engines_together_are_refused() -> None:
    with pytest.raises(ConfigError, match="set docker_host or \\[cluster\\] engines, not both"):
        cluster(["ssh://host2"], docker_host="unix:///var/run/docker.sock")


def test_host_directories_are_shared_only_with_local_engines(tmp_path: Path) -> None:
    mounts = [{"name": "data", "path": str(tmp_path)}]
    assert cluster(["unix:///var/run/docker.sock"], mounts=mounts).mounts
    with pytest.raises(ConfigError, match="ssh://host2 is not a unix socket"):
        cluster(["unix:///var/run/docker.sock", "ssh://host2"], mounts=mounts)
    with pytest.raises(ConfigError, match="would show the engine's socket"):
        cluster([f"unix://{tmp_path}/docker.sock"], mounts=mounts)
