"""Owners: every session and every turn row belongs to a user.

Adds ``owner`` (the logged-in user under ISAGI_AUTH, ``local`` otherwise) to
``sessions`` and ``turns``; rows written before this revision become
``local``, the owner of everything made without a login. The column keeps the
server default ``local`` (dropping it would need SQLite's table copy, whose
DROP of ``sessions`` would cascade into ``turns``); the application always
writes the owner explicitly.

Revision ID: 0002_owner
Revises: 0001_initial
Create Date: 2026-11-25
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0002_owner"
down_revision = "0001_initial"
branch_labels = None
depends_on = None

LOCAL = "local"


def upgrade() -> None:
    for table in ("sessions", "turns"):
        op.add_column(
            table,
            sa.Column("owner", sa.String(64), nullable=False, server_default=LOCAL),
        )
    op.create_index("ix_sessions_owner_updated", "sessions", ["owner", "updated_at"])
    op.create_index("ix_turns_owner", "turns", ["owner"])


def downgrade() -> None:
    op.drop_index("ix_turns_owner", table_name="turns")
    op.drop_index("ix_sessions_owner_updated", table_name="sessions")
    for table in ("turns", "sessions"):
        op.drop_column(table, "owner")
