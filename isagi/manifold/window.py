"""The history window: which earlier exchanges a turn's prompt holds.

Owns one rule, :func:`window_start`, a pure function of the session's accepted
exchanges (their token costs in the chat template) and of the room each turn
had for them (the prompt budget minus the system prompt and that turn's
message). The window keeps the newest exchanges and drops old ones in
**blocks**: while the history fits the room the window start stays where it
is, so every turn's prompt is the previous turn's prompt and reply plus the
new message, and on llama.cpp the saved KV cache of the previous turn
(:mod:`isagi.engines.kv_prefix`) covers all of it but the new tokens. When an
exchange no longer fits, the oldest exchanges are dropped until the history
takes at most :data:`KEEP_SHARE` of the room, which leaves room for many
turns before the next drop. Dropping one exchange per turn instead (a sliding
window) would change the prompt's start at every turn once the budget is
reached, and every such turn would evaluate the whole history again.

The start is replayed from the first exchange on every call, with the message
each turn actually had, so it depends on the session's turns alone: a session
saved and loaded, or a turn regenerated, gets the same window the live
session had.
"""

from __future__ import annotations

from collections.abc import Sequence

KEEP_SHARE = 0.5  # after a drop the history takes at most this share of the room


def window_start(costs: Sequence[int], rooms: Sequence[int], keep: float = KEEP_SHARE) -> int:
    """Index of the oldest exchange in the window after the last of ``costs``.

    ``costs[i]``: tokens exchange ``i`` takes in the prompt. ``rooms[i]``: tokens
    the history could take in the prompt of the turn after exchange ``i`` (the
    budget minus the system prompt and that turn's message). Replays the turns
    in order: exchange ``i`` joins the window; if the window then overflows
    ``rooms[i]``, the oldest exchanges leave until it takes at most
    ``keep * rooms[i]`` (the newest stays if it fits the room on its own, so a
    long exchange is not lost to the share), and an exchange larger than the
    whole room leaves too. Between overflows the start does not move.
    """
    if len(costs) != len(rooms):
        raise ValueError(f"{len(costs)} exchange costs but {len(rooms)} rooms")
    if not 0.0 <= keep <= 1.0:
        raise ValueError(f"keep={keep} is not a share between 0 and 1")
    start, total = 0, 0
    for i, (cost, room) in enumerate(zip(costs, rooms, strict=True)):
        total += cost
        if total <= room:
            continue
        while start < i and total > keep * room:
            total -= costs[start]
            start += 1
        if total > room:  # the newest alone does not fit
            start, total = i + 1, 0
    return start
