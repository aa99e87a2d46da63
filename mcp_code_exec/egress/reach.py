"""What an identity may reach: the ``[egress] allow`` entries its ``principals`` leave it, and what
a session narrowed that to. A reach is a tuple of entries' texts, in the configuration's order:
what the model sees, what a durable session's record keeps, and (as indices) what a grant claims."""

from __future__ import annotations

from collections.abc import Iterable, Sequence

from ..config.egress import EgressSettings
from ..config.principals import principal_matches
from ..errors import ReachRefused

Reach = tuple[str, ...]


def of_identity(settings: EgressSettings, identity: str) -> Reach:
    return tuple(entry.host for entry in settings.allow if principal_matches(identity, entry.principals))


def indices(settings: EgressSettings, reach: Iterable[str]) -> list[int]:
    wanted = set(reach)
    return [index for index, entry in enumerate(settings.allow) if entry.host in wanted]


def narrowed(current: Reach, wanted: Sequence[str]) -> Reach:
    """``current`` cut down to ``wanted`` (entries of it, as listed); never wider: an entry outside
    it is refused, naming what the session may reach."""
    unknown = [text for text in wanted if text not in current]
    if unknown:
        listed = ", ".join(current) if current else "nothing"
        raise ReachRefused(
            f"{unknown[0][:200]!r} is not in this session's egress, which can only be narrowed; it reaches: {listed}"
        )
    chosen = set(wanted)
    return tuple(text for text in current if text in chosen)


def kept(settings: EgressSettings, identity: str, stored: Reach | None) -> Reach:
    """A session's reach: its identity's, less what it narrowed away (``stored``, from its record:
    entries the configuration no longer has, or no longer gives the identity, are gone)."""
    full = of_identity(settings, identity)
    return full if stored is None else tuple(text for text in full if text in set(stored))


def describe(reach: Reach) -> str:
    """The reach as the model reads it."""
    if not reach:
        return "no host (egress is off for it)"
    return ", ".join(reach) + " (no port: 80 and 443)"
