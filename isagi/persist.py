"""Where a finished turn is kept: the history store and the session's autosaved file.

Owns :class:`TurnKeeper`, the object :class:`isagi.agent.Engine` is given to
persist each turn (the engine itself imports neither the history store nor
:mod:`isagi.session_io`, so the two never import each other). For each turn
it writes the history store's two rows (as the session's owner) and then rewrites the session's
``.miku`` file; a Regenerate *replaces* the session's last exchange in the
store instead of adding one, so the store, the live session and the file
always count the same turns.
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

    def __call__(self, session: Session, turn: Turn, *, replaces_last: bool = False) -> None:
        owner = session.owner
        if self.store is not None:
            self.store.ensure_session(session.id, owner=owner, model_id=self.model_id, title=session.title)
            if replaces_last:
                self.store.replace_last_turn(session.id, turn, owner=owner)
            else:
                self.store.record_turn(session.id, turn, owner=owner)
        if self.save is not None and session.miku_path is not None:
            self.save(session, Path(session.miku_path))
            if self.store is not None:
                self.store.set_miku_path(session.id, str(session.miku_path), owner=owner)


def default_keeper(engine: Any, store: Any) -> TurnKeeper:
    """The keeper an engine started by :meth:`isagi.agent.Engine.start` uses."""
    from isagi.session_io import save_session

    return TurnKeeper(store, lambda session, path: save_session(engine, session, path), model_id=engine.lm.model_id)
