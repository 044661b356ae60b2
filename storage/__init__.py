"""Persistence: the ``.miku`` v2 session file and the SQL history store.

``storage.miku`` owns the session file format (and, in ``storage.miku.legacy``,
the import of the research code's v1 pair), ``storage.history`` the history
database and ``storage.migrations`` its Alembic revisions. Nothing here
imports model code; importing the package does no work.
"""
