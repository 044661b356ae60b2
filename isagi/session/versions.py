"""A turn's reply versions: each Regenerate keeps the reply it replaced (the page's ‹ 2/3 ›).

Owns :class:`ReplyVersions` (the replies one turn has had, oldest first, and which is current)
and their form in a ``.miku`` file: the settings key ``reply_versions``, a list of
``{"turn": i, "current": c, "replies": [...]}`` where each reply is the assistant message of
:meth:`~isagi.session.turn.Turn.to_messages` (the message list keeps only the current one; its
fields are scalars, so the other versions live in the settings). Read strictly: a malformed
entry is a refusal that names it, as every other field of a file.

Which version is current is the session's: the conversation continues from it, the history
store and the file hold it as the turn's reply, and memory answers with it.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from isagi.session.turn import Turn

MAX_VERSIONS = 20  # replies kept per turn; a Regenerate past it forgets the oldest


@dataclass
class ReplyVersions:
    """The replies a turn has had, oldest first; ``current`` indexes the one the turn shows."""

    replies: list[Turn]
    current: int

    def with_new(self, turn: Turn) -> ReplyVersions:
        """These versions and ``turn`` (a Regenerate's reply) as the newest and current one."""
        replies = [*self.replies, turn][-MAX_VERSIONS:]
        return ReplyVersions(replies, len(replies) - 1)


def versions_to_extra(versions: Mapping[int, ReplyVersions]) -> list[dict[str, Any]]:
    """The session's versions as the file's ``reply_versions`` setting (turn order)."""
    return [{"turn": i, "current": v.current, "replies": [t.to_messages()[1] for t in v.replies]}
            for i, v in sorted(versions.items()) if len(v.replies) > 1]


def versions_from_extra(value: object, turns: list[Turn]) -> dict[int, ReplyVersions]:
    """The file's ``reply_versions`` setting as the session's versions; ``ValueError`` naming what
    is wrong (a turn the file lacks, a current version out of range, a reply that is not a map)."""
    if value is None:
        return {}
    if not isinstance(value, list):
        raise ValueError("reply_versions is not a list")
    out: dict[int, ReplyVersions] = {}
    for n, entry in enumerate(value):
        where = f"reply_versions[{n}]"
        if not isinstance(entry, dict):
            raise ValueError(f"{where} is not a map")
        i, current, replies = entry.get("turn"), entry.get("current"), entry.get("replies")
        if not isinstance(i, int) or isinstance(i, bool) or not 0 <= i < len(turns) or i in out:
            raise ValueError(f"{where} names turn {i!r}, which the conversation does not have (or twice)")
        if not isinstance(replies, list) or not 2 <= len(replies) <= MAX_VERSIONS \
                or not all(isinstance(r, dict) for r in replies):
            raise ValueError(f"{where} must hold 2 to {MAX_VERSIONS} replies, each a map")
        if not isinstance(current, int) or isinstance(current, bool) or not 0 <= current < len(replies):
            raise ValueError(f"{where} has current version {current!r} of {len(replies)}")
        user = turns[i].to_messages()[0]
        versions = [Turn.from_messages(user, {**r, "role": "assistant", "text": r.get("text", "")})
                    for r in replies]
        versions[current] = turns[i]  # the conversation's own copy is the current one
        out[i] = ReplyVersions(versions, current)
    return out
