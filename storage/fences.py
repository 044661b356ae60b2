"""Fencing tokens of the session leases: which acquisition of a session's lease may still write it.

A live session's lease (:mod:`isagi.session.lease`) is a PostgreSQL advisory lock on one
connection of the process that holds it. PostgreSQL frees that lock when the connection ends,
which may happen while the process lives on (PostgreSQL restarted, a network cut,
``pg_terminate_backend``, a pause long enough for keepalive to give up): another process then
takes the session, and without more the first one's pending writes (the turn it was running)
would still land after the second one's. The fence closes that gap, as a fencing token does
for any lock (M. Kleppmann, "How to do distributed locking", 2016):

- every acquisition bumps the session's **epoch**, a row of ``session_leases`` (Alembic
  revision 0004), in the very statement that takes the lock (:data:`ACQUIRE`), and the holder
  keeps the epoch it got (:class:`Fence`);
- every write of that session (its ``.miku`` bytes, its history rows) first locks that row
  ``FOR SHARE`` in the write's own transaction and goes on only if the epoch is still the
  holder's (:func:`check`); otherwise it raises :class:`~isagi.errors.SessionMoved` and
  writes nothing. The row lock makes the two orderable: a new acquisition's bump waits for a
  write in progress to commit (and then reads what it wrote), and a write after the bump sees
  the new epoch.

Rows are never deleted (an epoch only grows, so no stale token can match again); a row is a
session id and a number. With the default sessions directory there are no leases and no fences.
"""

from __future__ import annotations

import uuid
from dataclasses import dataclass
from typing import TYPE_CHECKING

from isagi.errors import SessionMoved

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection, Engine

# One statement, so that the lock and the bump are one step: the lock (session level, on the
# lease connection) and, only when it was granted, the session's epoch made one higher
# (1 for a session never leased). Its one value: the new epoch, or NULL when another holds it.
ACQUIRE = (
    "WITH lock AS (SELECT pg_try_advisory_lock(:k) AS ok), "
    "bump AS (INSERT INTO session_leases (session_id, epoch) SELECT :sid, 1 FROM lock WHERE ok "
    "ON CONFLICT (session_id) DO UPDATE SET epoch = session_leases.epoch + 1 RETURNING epoch) "
    "SELECT (SELECT epoch FROM bump)"
)
_CHECK = "SELECT epoch FROM session_leases WHERE session_id = :sid FOR SHARE"


@dataclass
class Fence:
    """One acquisition of a session's lease: its id and the epoch it got. ``lost`` turns True
    when a write finds the epoch changed (another process took the session): nothing more of
    this holder's may be written, and it drops its copy."""

    session_id: str
    epoch: int
    lost: bool = False


def check(conn: Connection, fence: Fence) -> None:
    """Inside a write's transaction on the database of the leases: lock the session's epoch row
    until that transaction ends, and raise :class:`~isagi.errors.SessionMoved` (marking
    ``fence`` lost) unless the epoch is still ``fence``'s."""
    import sqlalchemy as sa

    epoch = conn.execute(sa.text(_CHECK), {"sid": fence.session_id}).scalar()
    if epoch != fence.epoch:
        fence.lost = True
        raise SessionMoved()


def same_database(leases: Engine, other: Engine) -> bool:
    """Whether ``other`` reaches the database (and schema) whose ``session_leases`` ``leases``
    writes: a row written through one is looked for through the other (URLs may differ and
    still meet, through a pooler). SQLite is never it."""
    import sqlalchemy as sa

    if leases.dialect.name != "postgresql" or other.dialect.name != "postgresql":
        return False
    probe = f"~probe-{uuid.uuid4().hex}"  # no session id starts with "~"
    with leases.begin() as conn:
        conn.execute(sa.text("INSERT INTO session_leases (session_id, epoch) VALUES (:sid, 0)"), {"sid": probe})
    try:
        with other.connect() as conn:
            return conn.execute(sa.text("SELECT count(*) FROM session_leases WHERE session_id = :sid"),
                                {"sid": probe}).scalar() == 1
    finally:
        with leases.begin() as conn:
            conn.execute(sa.text("DELETE FROM session_leases WHERE session_id = :sid"), {"sid": probe})
