"""Where a finished turn is kept: the history store and the session's autosaved file.

Owns :class:`TurnKeeper`, the object :class:`isagi.agent.Engine` is given to
persist each turn (the engine itself imports neither the history store nor
:mod:`isagi.session_io`, so the two never import each other). For each turn
it writes the history store's two rows (as the session's owner; the session
row is created on its first turn, in the same transaction) and then rewrites
the session's ``.miku`` file, whose path the store is told when it is new to
it; a Regenerate *replaces* the session's last exchange in the store instead
of adding one, so the store, the live session and the file always count the
same turns.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from isagi.session import Session
    from isagi.turn import Turn

SaveFile = Callable[["Session", Path], None]


class TurnKeeper:
    """Persist a turn: a history row pair (``store``, optional) and the autosave (``save``).

    ``save(session, path)`` writes the session's file; the engine's default is
    :func:`isagi.session_io.save_session` bound to the engine.
    """

    def __init__(self, store: Any = None, save: SaveFile | None = None, *, model_id: str = "") -> None:
        self.store = store
        self.save = save
        self.model_id = model_id
        self._told: dict[tuple[str, str], str] = {}  # (owner, session id) -> the file path the store holds

    def __call__(self, session: Session, turn: Turn, *, replaces_last: bool = False) -> None:
        owner = session.owner
        key = (owner, session.id)
        if self.store is not None:
            _n, created = self.store.record_exchange(session.id, turn, owner=owner, model_id=self.model_id,
                                                     title=session.title, replace_last=replaces_last)
            if created:
                self._told.pop(key, None)
        if self.save is not None and session.miku_path is not None:
            path = str(session.miku_path)
            self.save(session, Path(path))
            if self.store is not None and self._told.get(key) != path:
                self.store.set_miku_path(session.id, path, owner=owner)
                if len(self._told) >= 4096:  # a bound for a long-running server; forgetting costs one write
                    self._told.clear()
                self._told[key] = path


def default_keeper(engine: Any, store: Any) -> TurnKeeper:
    """The keeper an engine started by :meth:`isagi.agent.Engine.start` uses."""
    from isagi.session_io import save_session

    return TurnKeeper(store, lambda session, path: save_session(engine, session, path), model_id=engine.lm.model_id)
