"""A session's title: the one rule, :func:`session_title` (a given title, else its first message).

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


def session_title(title: str | None, first_message: str | None = None) -> str | None:
    """The title of a session: ``title`` if it was given one (as :func:`make_title` writes it),
    else one made from its first message; None while it has neither."""
    if title:
        return make_title(title)
    return None if first_message is None else make_title(first_message)
