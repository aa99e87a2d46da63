"""``[quotas]`` and ``[audit]``: how much each identity may spend, and the record of what was done.

Quotas are per identity (an HTTP token's name, an OAuth subject, a stdio identity): ``default``
holds for every identity, and ``[quotas.identities]`` replaces some of its values for one identity
or a group of them (the names ``[code_mode]`` principals use: ``alice`` is the token named alice,
``local`` every stdio client, ``local:NAME``, ``user:NAME``, ``token:NAME`` or an OAuth identity
one identity alone). A value of 0 is no limit, except ``stored_mb``, which always holds.
"""

from __future__ import annotations

from pathlib import Path
from typing import Literal

from pydantic import Field, SecretStr, field_validator

from .principals import principal_matches
from .sections import Section, refused
from .units import MIB

ENV_AUDIT_KEY = "MCP_CODE_EXEC_AUDIT_KEY"
# The quotas' names, as refusals, get_usage and the metrics call them.
RUNS_PER_MINUTE = "runs_per_minute"
CPU_PER_HOUR = "cpu_s_per_hour"
CPU_PER_DAY = "cpu_s_per_day"
INSTALLS_PER_DAY = "package_installs_per_day"
STORED = "stored_mb"
QUOTA_NAMES = (RUNS_PER_MINUTE, CPU_PER_HOUR, CPU_PER_DAY, INSTALLS_PER_DAY, STORED)
MAX_OVERRIDES = 10_000


class QuotaLimits(Section):
    runs_per_minute: int = Field(0, ge=0, description="runs an identity may start in any 60 s (0: no limit)")
    cpu_s_per_hour: float = Field(
        0.0,
        ge=0,
        description="CPU seconds (user and system) an identity's runs may use in any hour (0: no limit); "
        "a run is admitted while the identity is under it, and charged what it used when it ends",
    )
    cpu_s_per_day: float = Field(0.0, ge=0, description="the same in any 24 hours (0: no limit)")
    package_installs_per_day: int = Field(
        0, ge=0, description="packages an identity's runs may install in any 24 hours, each counted once (0: no limit)"
    )
    stored_mb: int = Field(
        16384,
        ge=8,
        description="disk an identity's sessions may hold, live and paused (forks included), each counted at its "
        "quota (limits.session_data_mb); a new session or fork past it is refused",
    )

    @property
    def stored_bytes(self) -> int:
        return self.stored_mb * MIB


class QuotaOverride(Section):
    """One identity's (or group's) own values; a key left out keeps the default's."""

    runs_per_minute: int | None = Field(None, ge=0)
    cpu_s_per_hour: float | None = Field(None, ge=0)
    cpu_s_per_day: float | None = Field(None, ge=0)
    package_installs_per_day: int | None = Field(None, ge=0)
    stored_mb: int | None = Field(None, ge=8)


class QuotaSettings(Section):
    default: QuotaLimits = Field(default_factory=QuotaLimits, description="every identity's quotas")
    identities: dict[str, QuotaOverride] = Field(
        default_factory=dict,
        max_length=MAX_OVERRIDES,
        description="an identity's (or group's) own quotas in place of some of the default's: a token name, "
        '"local" (every stdio client), "local:NAME", "user:NAME", "token:NAME" or an OAuth identity',
    )

    def limits_for(self, identity: str) -> QuotaLimits:
        """The quotas of ``identity``: its own entry, else the first group entry it belongs to, over the default."""
        override = self.identities.get(identity)
        if override is None:
            override = next((o for name, o in self.identities.items() if principal_matches(identity, [name])), None)
        if override is None:
            return self.default
        return self.default.model_copy(update=override.model_dump(exclude_none=True))

    @property
    def counted(self) -> bool:
        """Whether any identity has a quota that is counted over time (the store is needed at all)."""
        counted = (RUNS_PER_MINUTE, CPU_PER_HOUR, CPU_PER_DAY, INSTALLS_PER_DAY)
        return any(getattr(limit, name) for limit in [self.default, *self.identities.values()] for name in counted)


class AuditSettings(Section):
    path: str = Field(
        "",
        description="the audit log: one JSON line per call that runs code or changes state, each chained to the "
        "one before by its hash (absolute, or under ~); empty: no audit log",
    )
    identities: Literal["hashed", "named"] = Field(
        "hashed", description="how lines name an identity: its hash (as session records do), or its name"
    )
    include_code: bool = Field(False, description="write each run's code (its SHA-256 and size are always written)")
    required: bool = Field(
        False, description="refuse every call while the log cannot be written; false: go on, and say so"
    )
    max_mb: int = Field(64, ge=1, description="the log file is rotated when it reaches this size, the chain carried on")
    keep: int = Field(0, ge=0, description="rotated files kept, the oldest removed first (0: all)")
    fsync: bool = Field(False, description="sync every line to the disk (survives a machine crash; slower)")
    key: SecretStr | None = Field(
        None,
        description="chain the lines with HMAC-SHA256 under this key, so only its holder can make a chain that "
        "verifies (prefer the MCP_CODE_EXEC_AUDIT_KEY environment variable)",
    )

    @property
    def max_bytes(self) -> int:
        return self.max_mb * MIB

    @field_validator("path")
    @classmethod
    def _absolute(cls, value: str) -> str:
        if value and not Path(value).expanduser().is_absolute():
            raise refused(f"{value!r}: give an absolute path, or one under ~ (the local service changes directory)")
        return value

    @property
    def file(self) -> Path | None:
        return Path(self.path).expanduser() if self.path else None
