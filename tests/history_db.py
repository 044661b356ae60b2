"""Blank history databases for the history-store tests: a SQLite file, or a fresh
schema on the PostgreSQL server named by ``ISAGI_TEST_POSTGRES_URL`` (dropped after).

The ``db_url`` and ``store`` fixtures built on these live in ``tests/conftest.py``.
"""

from __future__ import annotations

import os
import uuid

import sqlalchemy as sa

PG_URL = os.environ.get("ISAGI_TEST_POSTGRES_URL")


def fresh_pg_schema() -> tuple[str, str]:
    """A new, empty PostgreSQL schema and a URL whose connections use it."""
    schema = "t_" + uuid.uuid4().hex[:12]
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.execute(sa.text(f'CREATE SCHEMA "{schema}"'))
    engine.dispose()
    url = sa.make_url(PG_URL).update_query_dict({"options": f"-csearch_path={schema}"})
    return schema, url.render_as_string(hide_password=False)


def drop_pg_schema(schema: str) -> None:
    engine = sa.create_engine(PG_URL)
    with engine.begin() as conn:
        conn.execute(sa.text(f'DROP SCHEMA "{schema}" CASCADE'))
    engine.dispose()
