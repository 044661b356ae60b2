"""Session retention: removing the sessions nobody has touched for a stated number of days.

Owns which sessions are old and their removal: the history rows (turns, then the session's
row) and the ``.miku`` autosave in the sessions folder, the same two things ``isagi sessions
delete`` removes. A session is old when its last update (the history's ``updated_at``; for a
file with no history row, the file's modification time) lies more than ``older_than_days``
before now. A session open in the server (``is_live``) is never removed, however old, nor one
another replica holds (its lease, :func:`isagi.session.lease.maintenance_holds`: each removal
holds the session's lease while it runs). With the store shared by replicas, each removal also
carries that lease's fence (its history rows and its file are deleted only while it is
current, :mod:`isagi.storage.fences`): a pass whose lease connection broke mid-pass, while
another replica took the session and went on writing it, removes nothing of it (the
session is counted as kept, left to that replica) instead of deleting what it still writes.

``ISAGI_SESSION_RETENTION`` (days; unset: keep everything) has the server run this at its start
and daily after (:class:`RetentionTimer`); ``isagi sessions prune --older-than DAYS`` runs it
by hand.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from isagi.errors import SessionMoved

if TYPE_CHECKING:
    from isagi.session.lease import Hold
    from isagi.session.store import SessionStore
    from isagi.storage.history import HistoryStore

log = logging.getLogger(__name__)

DAY_S = 86_400.0


@dataclass
class Pruned:
    """What one pass removed (or, dry, would remove)."""

    sessions: list[str] = field(default_factory=list)  # session ids, history rows and files alike
    files: list[Path] = field(default_factory=list)
    kept_live: int = 0  # old sessions left alone because a server (this one or another) has them open


def prune_sessions(
    store: HistoryStore | None,
    files: SessionStore,
    older_than_days: float,
    *,
    now: float | None = None,
    is_live: Callable[[str], bool] | None = None,
    dry_run: bool = False,
) -> Pruned:
    """Remove every session last updated more than ``older_than_days`` ago (module docstring).

    ``store``: the history store (a :class:`storage.history.HistoryStore`) or None (files only).
    ``dry_run``: only say what would go.
    """
    from isagi.session.lease import maintenance_holds

    if not older_than_days > 0:
        raise ValueError(f"older_than_days must be above 0, not {older_than_days!r}")
    with maintenance_holds(files, store) as hold:
        return _prune(store, files, older_than_days, now=now, is_live=is_live, dry_run=dry_run, hold=hold)


def _prune(store: HistoryStore | None, files: SessionStore, older_than_days: float, *, now: float | None,
           is_live: Callable[[str], bool] | None, dry_run: bool, hold: Hold) -> Pruned:
    now = time.time() if now is None else now
    cutoff = now - older_than_days * DAY_S
    live = is_live or (lambda _sid: False)
    out = Pruned()
    known: set[str] = set()
    if store is not None:
        for sid, (owner, updated) in sorted(store.session_times().items()):
            known.add(sid)
            if updated.timestamp() >= cutoff:
                continue
            with hold(sid) as claim:
                if live(sid) or not claim.free:
                    out.kept_live += 1
                    continue
                recorded = None
                with contextlib.suppress(Exception):
                    recorded = store.get_session(sid, owner=owner).miku_path
                if dry_run:
                    out.sessions.append(sid)
                    found = files.find(sid, recorded)
                    out.files += [found] if found else []
                    continue
                try:
                    if store.delete_session(sid, owner=owner, fence=claim.fence):
                        out.sessions.append(sid)
                        out.files += files.remove(sid, recorded, fence=claim.fence)
                except SessionMoved:  # another replica took it over meanwhile: its to keep
                    out.kept_live += 1
    for path in files.all():  # files the history does not know (no store, or a row lost)
        sid = path.stem
        if sid in known:
            continue
        written = files.modified(path)
        if written is None or written >= cutoff:
            continue
        with hold(sid) as claim:
            if live(sid) or not claim.free:
                out.kept_live += 1
                continue
            if dry_run:
                out.sessions.append(sid)
                out.files.append(path)
                continue
            try:
                out.files += files.remove(sid, fence=claim.fence)
            except SessionMoved:
                out.kept_live += 1
                continue
            out.sessions.append(sid)
    return out


class RetentionTimer:
    """Runs :func:`prune_sessions` now and every ``interval_s`` after, on a daemon thread, until
    :meth:`stop`. A pass that fails is logged in one line and tried again at the next.

    ``ready``: called once before the first pass, blocking until the server can run one (its
    model and history store loaded); False ends the timer (the server failed to start).
    """

    def __init__(self, run: Callable[[], Pruned], interval_s: float = DAY_S,
                 ready: Callable[[], bool] | None = None) -> None:
        self._run = run
        self._ready = ready
        self._interval = float(interval_s)
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    def start(self) -> None:
        if self._thread is not None:
            return
        self._thread = threading.Thread(target=self._loop, name="isagi-retention", daemon=True)
        self._thread.start()

    def _loop(self) -> None:
        if self._ready is not None and not self._ready():
            return
        while not self._stop.is_set():
            try:
                pruned = self._run()
                if pruned.sessions:
                    log.warning("retention: removed %d sessions (%d files) past their retention",
                                len(pruned.sessions), len(pruned.files))
            except Exception as exc:  # a full disk, a database away: try again next time
                log.warning("retention: this pass failed (%s); it runs again in %.0f s", exc, self._interval)
            self._stop.wait(self._interval)

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join(timeout=5)
            self._thread = None

