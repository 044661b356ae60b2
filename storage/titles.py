"""A session's title: the one rule, from its first message.

A module of its own, with no imports, so the session (its title as it runs and in its
``.miku`` file), the history store and the page give every session the same title without
any of them loading SQLAlchemy for it.
"""

TITLE_MAX = 80


def make_title(text: str, limit: int = TITLE_MAX) -> str:
    """A one-line title from a first message: whitespace collapsed, cut at ``limit``."""
    line = " ".join(text.split())
    if len(line) <= limit:
        return line or "(empty)"
    return line[: limit - 1].rstrip() + "…"
