"""What the browser may be told of a server-side failure: the words, never a server path or URL.

Owns :func:`public_text`, applied to every message the web app shows (the
alert line and its pop-up, the loading banner, ``/health``'s error). The
messages of :mod:`isagi.errors` are written for the terminal, where naming
the file or the database helps the operator; in a browser the same detail
tells anyone who can reach the page how the server is laid out. The server
log keeps the full message.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

# scheme://anything up to a space or closing bracket (a database URL, with or without a password)
_URL = re.compile(r"\b[a-zA-Z][a-zA-Z0-9+.\-]*://[^\s'\"<>()\[\]{}]*")
# an absolute or home-relative path: "/" (or "~/") not inside a word, a number or another path
_PATH = re.compile(r"(?<![\w.~/:\-\0])~?/[^\s'\"`<>()\[\]{},;]+")
# a known server path (marked by public_text) and what follows it in the same path
_MARKED = re.compile(r"\0\d+\0[^\s'\"`<>()\[\]{},;]*")
_TRAILING = ".:"  # sentence punctuation after a path or URL stays in the sentence


def _sub(pattern: re.Pattern[str], word: str, text: str) -> str:
    def repl(m: re.Match[str]) -> str:
        found = m.group(0)
        kept = found.rstrip(_TRAILING)
        return word + found[len(kept):]

    return pattern.sub(repl, text)


def public_text(message: str, known: Iterable[str | None] = ()) -> str:
    """``message`` with every URL replaced by "the database" and every absolute path by
    "a server file", so what a user sees names nothing of the server's layout.

    ``known``: server paths and URLs to find even where a regular expression could
    not (they may hold spaces), e.g. the data directory and the database URL.
    """
    marks = sorted({k for k in known if k and len(k) > 1}, key=len, reverse=True)
    for i, text in enumerate(marks):  # a mark without spaces, so a URL around it stays one word
        message = message.replace(text, f"\0{i}\0")
    message = _sub(_URL, "the database", message)
    message = _sub(_MARKED, "a server file", message)
    return _sub(_PATH, "a server file", message)
