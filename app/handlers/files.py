"""The open session's living state as a file: Save ``.miku`` and Load ``.miku``.

An uploaded file is opened only when it is one of the caller's own uploads
(:class:`app.uploads.UploadLedger`; anything else, whatever the path, gets one neutral
answer) and is removed once read. A loaded file becomes a new session of the caller's (a
fork with a fresh id), written at once: its own file and every turn into the history store.
"""

from __future__ import annotations

import logging
import os
from pathlib import Path
from typing import Any

from isagi.app.handlers.page import NOT_LOGGED_IN, Page
from isagi.app.loader import EngineLoading
from isagi.app.render_safe import md_cell
from isagi.app.updates import PageUpdate
from isagi.app.uploads import NOT_YOUR_UPLOAD
from isagi.app.views import counted, download_name
from isagi.errors import SessionLimit

log = logging.getLogger(__name__)


class FileHandlers:
    """Save (outputs :data:`~app.updates.FILE`) and Load (outputs :data:`~app.updates.UPLOAD`)."""

    def __init__(self, page: Page) -> None:
        self.page = page

    def save_miku(self, sid: str | None, request: Any = None) -> PageUpdate:
        """Write the open session's living state to a ``.miku`` for download."""
        from isagi.errors import IsagiError

        p = self.page
        owner, _ = p.who(request)
        try:
            # the name carries no words of the chat: it goes into URLs, histories and logs
            path, s = p.sessions.save_copy(sid, owner, p.download_dir(), lambda s: download_name(s.id, "miku"))
            assert owner is not None
            p.hand_out(owner, path)
        except (KeyError, EngineLoading, IsagiError, OSError) as exc:
            msg = "There is no session to save yet." if isinstance(exc, KeyError) else str(exc)
            return PageUpdate(files_note=p.warn(msg))
        return PageUpdate(download=str(path),
                          files_note=(f"Saved {counted(len(s.memory), 'trajectory', 'trajectories')} and "
                                      f"{counted(len(s.turns), 'turn')} to `{path.name}`."))

    def load_miku(self, file: Any, sid: str | None, colour_by: str = "tier", request: Any = None) -> PageUpdate:
        """Open an uploaded ``.miku`` (a fork with a fresh id, the caller's).

        Only a file the caller uploaded (:meth:`UploadLedger.claim`) is opened;
        any other path, whatever it names and whether or not it exists, gets
        the one answer :data:`~app.uploads.NOT_YOUR_UPLOAD`. Errors leave the
        open session as it is and name the user's own file, never a server
        path. The upload is removed once read, loaded or not.

        A loaded session is written at once (its own file, and every turn into the history
        store), and the page does what Resume does: the sessions table lists it, the chat tab
        shows it, the previous chat's alert goes.
        """
        import gradio as gr

        from isagi.errors import IsagiError

        p = self.page
        owner, client = p.who(request)

        def refused(why: str) -> PageUpdate:
            return PageUpdate(state=sid, files_note=p.warn(why))

        if owner is None:
            return refused(NOT_LOGGED_IN)
        path = file.get("path") if isinstance(file, dict) else getattr(file, "name", file)
        claim = p.uploads.claim(owner, path)
        if claim is None:
            return refused(NOT_YOUR_UPLOAD)
        name = claim.name
        with claim:
            try:
                session = p.sessions.read_upload(claim.path)
            except (IsagiError, EngineLoading) as exc:
                reason = _hide_path(str(exc), claim.path).rstrip()
                reason += "" if reason.endswith((".", "!", "?")) else "."
                return refused(f"Could not load {name}: {reason} Your open session is unchanged.")
            except Exception as exc:  # a reader bug must not take the page down
                log.exception("loading an upload failed")
                return refused(f"Could not load {name} ({type(exc).__name__}: "
                               f"{_hide_path(str(exc), claim.path)}). Your open session is unchanged.")
        try:
            opened = p.sessions.adopt_upload(session, owner, client, leaving=sid)
        except SessionLimit as exc:
            return refused(str(exc))
        new = opened.sid
        note = p.left_note(opened.left_unsaved)
        kept = p.warn(opened.notice) if opened.notice else ""
        # No pop-up notice: the note says it, and a later refused file replaces the note, so the
        # page never says "Loaded" beside that error.
        loaded = (f"Loaded `{md_cell(name)}`: {counted(len(session.memory), 'trajectory', 'trajectories')}, "
                  f"{counted(len(session.turns), 'turn')}.")
        rows, _ = p.session_rows(owner)
        return p.view(new, colour_by, owner).but(
            state=new, files_note=loaded + "".join(f"\n\n{n}" for n in (note, kept) if n),
            table=rows, tabs=gr.Tabs(selected="chat"), alert=kept)


def _hide_path(message: str, path: str | os.PathLike[str]) -> str:
    """``message`` with the server's path of an uploaded file (and its folder) replaced
    by the file's own name: errors never show server paths."""
    p = Path(path)
    for full in sorted({str(p), str(p.resolve()), str(p.absolute())}, key=len, reverse=True):
        message = message.replace(full, p.name)
    for folder in sorted({str(p.parent), str(p.parent.resolve())}, key=len, reverse=True):
        if len(folder) > 1:
            message = message.replace(folder + os.sep, "").replace(folder, "")
    return message
