"""The caps' bookkeeping (service/caps.py): claims count until the session is made, forks are claimed
all or none, every volume an identity holds is charged, and idle sessions pause only within the
paused caps, in all and per identity. The engine tests: test_security_forks.py."""

from __future__ import annotations

from typing import Any, cast

import pytest

from mcp_code_exec.config.settings import load_config
from mcp_code_exec.errors import ConfigError, OverQuota, SessionLimit
from mcp_code_exec.sandbox.container import Sandbox
from mcp_code_exec.service.sessions import Session, SessionRegistry

LIVE = cast("Sandbox", object())  # a session with a container (never used here)


def registry(stored_mb: int = 16384, identities: dict[str, Any] | None = None, **sessions: Any) -> SessionRegistry:
    quotas = {"default": {"stored_mb": stored_mb}, "identities": identities or {}}
    overrides = {"sessions": sessions, "limits": {"session_data_mb": 100}, "quotas": quotas}
    config = load_config(environ={}, overrides=overrides)
    return SessionRegistry(config.sessions, config.limits.session_data_bytes, config.quotas)


def add(reg: SessionRegistry, owner: str, *, live: bool, last_used: float = 0.0) -> Session:
    session = Session(id=reg.new_id(), owner=owner, volume=f"v-{len(reg)}", sandbox=LIVE if live else None)
    session.last_used = last_used
    reg.add(session)
    return session


def test_forks_are_claimed_all_or_none_and_a_claim_counts_until_it_is_given_back() -> None:
    reg = registry(max_paused=10, max_paused_per_client=3)
    add(reg, "a", live=True)
    reg.caps.claim_forks("a", 2)
    with pytest.raises(SessionLimit, match="you hold 2"):
        reg.caps.claim_forks("a", 2)  # one slot left: two are refused whole
    reg.caps.claim_forks("b", 3)  # another identity's own share
    reg.caps.release_forks("a", 2)
    reg.caps.claim_forks("a", 3)
    with pytest.raises(SessionLimit, match="at most 10 paused sessions"):
        reg.caps.claim_forks("c", 5)


def test_every_volume_an_identity_holds_is_charged_against_its_stored_quota() -> None:
    reg = registry(400, {"token:c": {"stored_mb": 100}}, max_per_client=8, max_paused_per_client=8)
    add(reg, "a", live=True)
    add(reg, "a", live=False)
    reg.caps.claim_forks("a", 1)  # a fork being copied
    reg.caps.claim_live("a", new_volume=False)  # a resume brings no volume
    with pytest.raises(OverQuota, match=r"quota stored_mb reached: .*at most 400 MiB of disk at any time.*you hold 3"):
        reg.caps.claim_forks("a", 2)
    reg.caps.claim_live("a", new_volume=True)  # the fourth volume: 400 MiB
    with pytest.raises(OverQuota, match="it frees as sessions close") as refused:
        reg.caps.claim_live("a", new_volume=True)
    assert (refused.value.quota, refused.value.window_s, refused.value.frees_at) == ("stored_mb", None, None)
    reg.caps.claim_live("b", new_volume=True)
    reg.caps.claim_live("token:c", new_volume=True)  # its own quota: one session
    with pytest.raises(OverQuota, match="at most 100 MiB"):
        reg.caps.claim_live("token:c", new_volume=True)


def test_idle_sessions_pause_only_within_the_paused_caps_in_all_and_per_identity() -> None:
    reg = registry(max_paused=3, max_paused_per_client=2, pause_after_s=10)
    add(reg, "a", live=False)
    a_idle = [add(reg, "a", live=True, last_used=t) for t in (1, 2)]
    b_idle = [add(reg, "b", live=True, last_used=t) for t in (3, 4)]
    assert reg.to_pause(now=100) == [a_idle[0], b_idle[0]]  # a has one paused already; two in all are left


def test_a_stored_quota_below_one_sessions_quota_is_refused_at_load_and_the_old_key_named() -> None:
    overrides = {"quotas": {"default": {"stored_mb": 100}}, "limits": {"session_data_mb": 200}}
    with pytest.raises(ConfigError, match="no session would fit"):
        load_config(environ={}, overrides=overrides)
    with pytest.raises(ConfigError, match=r"sessions\.max_disk_per_client_mb: renamed to quotas\.default\.stored_mb"):
        load_config(environ={}, overrides={"sessions": {"max_disk_per_client_mb": 100}})
