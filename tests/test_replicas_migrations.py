"""Migrations run once: replica processes that start together on one fresh PostgreSQL schema
all open their stores, and the schema is migrated exactly once, to the head revision
(:func:`storage.migrations.upgrade_to_head`'s advisory lock)."""

from __future__ import annotations

import subprocess
import sys
import time
from pathlib import Path

import pytest
import sqlalchemy as sa

from isagi.storage.migrations import head_revision

pytestmark = pytest.mark.postgres

ROOT = Path(__file__).resolve().parent.parent
STARTS = 6  # processes opening their stores at the same moment: half histories, half session stores
WAIT_S = 120.0

# Each process imports, says it is ready, and opens its store once the go file exists.
OPEN = """
import os, sys, time
from isagi.session.dbstore import DatabaseSessionFiles
from isagi.storage.history import HistoryStore
url, kind, folder, gate = sys.argv[1:5]
open(gate + "." + str(os.getpid()), "w").close()
while not os.path.exists(gate):
    time.sleep(0.005)
store = HistoryStore(url) if kind == "history" else DatabaseSessionFiles(url, folder)
store.close()
"""


def _open_all_at_once(url: str, tmp_path: Path) -> list[str]:
    """Start :data:`STARTS` processes that each open a store of ``url`` at one moment; the
    failures (exit status and what they printed)."""
    gate = tmp_path / "go"
    procs = [subprocess.Popen([sys.executable, "-c", OPEN, url, "history" if i % 2 else "sessions",
                               str(tmp_path / f"sessions-{i}"), str(gate)], cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.STDOUT, text=True)
             for i in range(STARTS)]
    deadline = time.monotonic() + WAIT_S
    while len(list(tmp_path.glob("go.*"))) < STARTS and time.monotonic() < deadline \
            and all(p.poll() is None for p in procs):
        time.sleep(0.01)
    gate.touch()  # all ready (or one failed already): go
    failures = []
    for proc in procs:
        out, _ = proc.communicate(timeout=WAIT_S)
        if proc.returncode != 0:
            failures.append(f"exit {proc.returncode}: {out[-1500:]}")
    return failures


def test_replicas_started_at_once_on_a_fresh_schema_migrate_it_once(pg_url: str, tmp_path: Path) -> None:
    failures = _open_all_at_once(pg_url, tmp_path)
    assert not failures, failures
    engine = sa.create_engine(pg_url)
    try:
        with engine.connect() as conn:
            versions = conn.execute(sa.text("SELECT version_num FROM alembic_version")).scalars().all()
            tables = set(sa.inspect(conn).get_table_names())
    finally:
        engine.dispose()
    assert versions == [head_revision()]
    assert {"sessions", "turns", "session_files", "alembic_version"} <= tables
