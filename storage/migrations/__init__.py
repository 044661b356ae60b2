"""Alembic migrations of the history database, usable from an installed package.

The revisions live in ``storage/migrations/versions``; ``env.py`` runs them on
a connection handed over through the Alembic config, so opening a
:class:`storage.history.HistoryStore` migrates its database without any
``alembic.ini`` or working directory. ``storage/alembic.ini`` is only for
developers running the ``alembic`` command from the repository root.
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


def upgrade_to_head(connection: Connection) -> None:
    """Apply every missing revision on ``connection`` (inside its transaction)."""
    from alembic import command

    command.upgrade(alembic_config(connection=connection), "head")


def head_revision() -> str:
    """The newest revision id shipped with this package."""
    from alembic.script import ScriptDirectory

    head = ScriptDirectory.from_config(alembic_config()).get_current_head()
    assert head is not None
    return head
