"""Initial history schema: sessions and turns.

Revision ID: 0001_initial
Revises:
Create Date: 2026-11-22
"""

from __future__ import annotations

import sqlalchemy as sa
from alembic import op

revision = "0001_initial"
down_revision = None
branch_labels = None
depends_on = None


def upgrade() -> None:
    op.create_table(
        "sessions",
        sa.Column("id", sa.String(64), primary_key=True),
        sa.Column("title", sa.String(200), nullable=True),
        sa.Column("model_id", sa.String(200), nullable=False),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("updated_at", sa.DateTime(timezone=True), nullable=False),
        sa.Column("miku_path", sa.Text(), nullable=True),
    )
    op.create_table(
        "turns",
        sa.Column("id", sa.Integer(), primary_key=True, autoincrement=True),
        sa.Column(
            "session_id",
            sa.String(64),
            sa.ForeignKey("sessions.id", ondelete="CASCADE", name="fk_turns_session_id"),
            nullable=False,
        ),
        sa.Column("seq", sa.Integer(), nullable=False),
        sa.Column("role", sa.String(16), nullable=False),
        sa.Column("text", sa.Text(), nullable=False),
        sa.Column("tier", sa.String(16), nullable=True),
        sa.Column("distance", sa.Float(), nullable=True),
        sa.Column("nearest_query", sa.Text(), nullable=True),
        sa.Column("zone", sa.String(32), nullable=True),
        sa.Column("teh_prompt", sa.Float(), nullable=True),
        sa.Column("teh_reply", sa.Float(), nullable=True),
        sa.Column("verdict", sa.String(16), nullable=False),
        sa.Column("latency_s", sa.Float(), nullable=True),
        sa.Column("prompt_tokens", sa.Integer(), nullable=True),
        sa.Column("new_tokens", sa.Integer(), nullable=True),
        sa.Column("metric_growth", sa.Float(), nullable=True),
        sa.Column("created_at", sa.DateTime(timezone=True), nullable=False),
        sa.UniqueConstraint("session_id", "seq", name="uq_turns_session_seq"),
    )


def downgrade() -> None:
    op.drop_table("turns")
    op.drop_table("sessions")
