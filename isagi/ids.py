"""Session ids: made only by the server, one pattern everywhere.

A session id names a file under ``$ISAGI_HOME/sessions`` and a row in the
history store, so it must never come from outside unchecked (a ``.miku`` file,
a browser, a command-line flag). This module owns how ids are made and what a
valid one looks like; everything that takes an id from outside checks it here.
"""

from __future__ import annotations

import re
import secrets
from typing import TypeGuard

#: 12 lowercase hexadecimal characters, as made by :func:`new_session_id`.
SESSION_ID_PATTERN = re.compile(r"[0-9a-f]{12}")


def new_session_id() -> str:
    """A fresh random session id (48 bits from the OS's CSPRNG)."""
    return secrets.token_hex(6)


def is_session_id(value: object) -> TypeGuard[str]:
    """True when ``value`` is a string of exactly the session id pattern."""
    return isinstance(value, str) and SESSION_ID_PATTERN.fullmatch(value) is not None
