"""What a sandbox container is started with, and the syscall filter it gets."""

from __future__ import annotations

import json
from typing import Any

from mcp_code_exec.config.settings import load_config
from mcp_code_exec.sandbox.seccomp import ALLOWED, profile, profile_json
from mcp_code_exec.sandbox.spec import container_spec, tmpfs_sizes


def test_every_container_gets_the_profile_no_time_wait_and_no_host_environment() -> None:
    config = load_config(environ={"MCP_CODE_EXEC_TOKEN": "secret"})
    spec = container_spec(config.sandbox, {"label": "x"})
    assert spec.seccomp_profile == profile_json(None)
    assert spec.sysctls == {"net.ipv4.tcp_max_tw_buckets": "0"}
    assert "secret" not in json.dumps(spec.environment) and not spec.network
    assert spec.tmpfs["/mnt/data"].startswith("rw,nosuid,nodev")  # stateless: a tmpfs, not a volume
    session = container_spec(config.sandbox, {}, volume="v1")
    assert "/mnt/data" not in session.tmpfs and session.volume == "v1"


def test_only_a_recycled_stateless_container_under_runc_gets_the_lean_interpreter() -> None:
    def lean(volume: str | None = None, **overrides: Any) -> bool:
        config = load_config(environ={}, overrides=overrides)
        return container_spec(config.sandbox, {}, volume=volume).environment.get("MCPX_LEAN_ZYGOTE") == "1"

    assert lean()
    assert not lean(volume="v1")  # a session's later cells may import anything
    assert not lean(pool={"mode": "single-use"})  # its one cell runs in the worker forked before it came
    assert not lean(pool={"lean_interpreter": False})
    assert not lean(runtime="runsc")


def test_tmpfs_sizes_are_scaled_to_fit_half_the_memory() -> None:
    config = load_config(environ={}, overrides={"limits": {"memory_mb": 256}})
    assert sum(tmpfs_sizes(config.limits, "stateless")) <= 128 << 20


def test_the_profile_refuses_what_a_sandbox_never_needs() -> None:
    allowed = set(profile()["syscalls"][0]["names"])
    for refused in ("io_uring_setup", "userfaultfd", "ptrace", "process_vm_readv", "bpf", "keyctl", "unshare", "mount"):
        assert refused not in allowed, refused
    not_implemented = profile()["syscalls"][1]
    assert set(not_implemented["names"]) >= {"io_uring_setup", "clone3"} and not_implemented["errnoRet"] == 38
    clone = [rule for rule in profile()["syscalls"] if rule["names"] == ["clone"]]
    assert clone[0]["args"][0]["op"] == "SCMP_CMP_MASKED_EQ"  # clone, never with namespace flags
    sockets = [rule for rule in profile()["syscalls"] if rule["names"] == ["socket"]]
    allowed_families = sorted(rule["args"][0]["value"] for rule in sockets if rule["action"] == "SCMP_ACT_ALLOW")
    assert allowed_families == [1, 16]  # no network: unix and netlink sockets only
    assert {rule["args"][0]["value"]: rule.get("errnoRet") for rule in sockets if "errnoRet" in rule} == {2: 97, 10: 97}
    with_network = profile(network=True)["syscalls"]
    assert sorted(rule["args"][0]["value"] for rule in with_network if rule["names"] == ["socket"]) == [1, 2, 10, 16]
    assert all(rule["action"] == "SCMP_ACT_ALLOW" for rule in with_network if rule["names"] == ["socket"])


def test_under_gvisor_clone3_is_allowed_and_its_older_names_are_known() -> None:
    allowed = set(profile("runsc")["syscalls"][0]["names"])
    assert {"clone3", "pselect6", "pselect"} <= allowed
    assert "clone3" not in profile("runsc")["syscalls"][1]["names"]


def test_the_allowlist_names_no_call_twice() -> None:
    names = [name for group in ALLOWED.values() for name in group]
    assert len(names) == len(set(names))
