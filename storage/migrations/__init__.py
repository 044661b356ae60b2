"""Alembic migrations of the history database, usable from an installed package.

The revisions live in ``storage/migrations/versions``; ``env.py`` runs them on
a connection handed over through the Alembic config, so opening a
:class:`storage.history.HistoryStore` migrates its database without any
``alembic.ini`` or working directory. ``storage/alembic.ini`` is only for
developers running the ``alembic`` command from the repository root.

Migrations run once, however many processes start together (replicas on one PostgreSQL
server): :func:`upgrade_to_head` first takes a transaction-level advisory lock there, so the
others wait for the first one's commit and then find the schema at its head. SQLite needs none:
its ``BEGIN IMMEDIATE`` (:mod:`storage.history`) already lets one writer in at a time.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from alembic.config import Config
    from sqlalchemy.engine import Connection

SCRIPT_LOCATION = Path(__file__).resolve().parent


def alembic_config(url: str | None = None, connection: Connection | None = None) -> Config:
    """A programmatic Alembic ``Config`` pointing at these revisions."""
    from alembic.config import Config

    cfg = Config()
    cfg.set_main_option("script_location", str(SCRIPT_LOCATION))
    if url is not None:
        cfg.set_main_option("sqlalchemy.url", url.replace("%", "%%"))
    if connection is not None:
        cfg.attributes["connection"] = connection
    return cfg


# pg_advisory_xact_lock's key of the migrations (any fixed number: one per database)
MIGRATION_LOCK = 0x15A61_0001


def upgrade_to_head(connection: Connection) -> None:
    """Apply every missing revision on ``connection`` (inside its transaction). On PostgreSQL,
    behind an advisory lock held until that transaction ends: processes starting together
    migrate one after the other, never at once."""
    from alembic import command

    if connection.dialect.name == "postgresql":
        import sqlalchemy as sa

        connection.execute(sa.text("SELECT pg_advisory_xact_lock(:k)"), {"k": MIGRATION_LOCK})
    command.upgrade(alembic_config(connection=connection), "head")


def head_revision() -> str:
    """The newest revision id shipped with this package."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head
