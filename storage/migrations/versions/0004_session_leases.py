"""Session lease epochs: ``session_leases`` holds each leased session's fencing epoch.

Each acquisition of a session's lease makes its epoch one higher, and every write of the session
checks it is still the writer's (:mod:`storage.fences`). Used only when ``ISAGI_SESSIONS_URL``
puts the sessions in PostgreSQL; with the default sessions directory the table stays empty.

Revision ID: 0004_session_leases
Revises: 0003_session_files
Create Date: 2026-12-10
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0004_session_leases"
down_revision = "0003_session_files"
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "session_leases",
        sa.Column("session_id", sa.String(64), primary_key=True),
        sa.Column("epoch", sa.BigInteger(), nullable=False),
    )


def downgrade() -> None:
    op.drop_table("session_leases")
