"""Session files in the database: ``session_files`` holds each ``.miku`` file's bytes by name.

Used only when ``ISAGI_SESSIONS_URL`` puts the sessions in PostgreSQL (several replicas share
them); with the default sessions directory the table stays empty.

Revision ID: 0003_session_files
Revises: 0002_owner
Create Date: 2026-12-02
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0003_session_files"
down_revision = "0002_owner"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "session_files",
        sa.Column("name", sa.String(80), primary_key=True),
        sa.Column("data", sa.LargeBinary(), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("session_files")
