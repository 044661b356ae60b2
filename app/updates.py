"""What a handler changes on the page, by name: :class:`PageUpdate` and each event's outputs.

A handler returns (or, streaming, yields) a :class:`PageUpdate` naming the components it
changes; every field it leaves out stays as it is on the page. Each event is wired
(:func:`app.layout.build_blocks`) with one of the output lists below, and
:meth:`PageUpdate.out` turns an update into the tuple Gradio takes in that order, so
no handler builds a positional tuple and none can set a component its event does not
output (``out`` raises); :meth:`PageUpdate.value` is what the wiring hands Gradio. Tests read an update by name (``update.chat``).
"""

from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

KEEP: Any = object()  # a component left as it is on the page (``gr.skip()`` at the boundary)


@dataclass(frozen=True)
class PageUpdate:
    """The page's components a handler changes; ``KEEP`` (the default) leaves one as it is.

    Chat tab: ``state`` (the page's session id), ``chat``, ``textbox``, ``alert``, ``status``
    (the banner), ``seen`` (what the page has drawn, for its sync), ``timer`` (the loading
    banner's timer) and the five manifold panels ``turn``, ``summary``, ``map``, ``growth``,
    ``teh``. Sessions tab: ``table``, ``chosen``, ``sessions_note``, ``pending`` (the id a
    Delete waits to have confirmed), ``confirm`` and ``cancel`` (its two buttons),
    ``download``, ``files_note``, ``tabs`` (which tab is shown). The browser's storage:
    ``stored``. Explorer: ``ex_steps``, ``ex_plot``, ``mcb``. The chat list (sidebar):
    ``chats`` (the list, its value the open chat), ``chat_title`` (the open chat's title, where
    it is renamed), ``chat_confirm`` and ``chat_cancel`` (Delete's two buttons). ``edit_turn``:
    the position of the turn whose message the page's Edit is changing ('' when none).
    """

    state: Any = KEEP
    chat: Any = KEEP
    textbox: Any = KEEP
    alert: Any = KEEP
    turn: Any = KEEP
    summary: Any = KEEP
    map: Any = KEEP
    growth: Any = KEEP
    teh: Any = KEEP
    status: Any = KEEP
    seen: Any = KEEP
    timer: Any = KEEP
    stored: Any = KEEP
    table: Any = KEEP
    chosen: Any = KEEP
    sessions_note: Any = KEEP
    pending: Any = KEEP
    confirm: Any = KEEP
    cancel: Any = KEEP
    download: Any = KEEP
    files_note: Any = KEEP
    tabs: Any = KEEP
    ex_steps: Any = KEEP
    ex_plot: Any = KEEP
    mcb: Any = KEEP
    chats: Any = KEEP
    chat_title: Any = KEEP
    chat_confirm: Any = KEEP
    chat_cancel: Any = KEEP
    edit_turn: Any = KEEP

    def but(self, **changes: Any) -> PageUpdate:
        """This update with ``changes`` too (e.g. a view with the session id and a note)."""
        return replace(self, **changes)

    def changed(self) -> dict[str, Any]:
        """The components this update sets, by name."""
        return {f.name: v for f in fields(self) if (v := getattr(self, f.name)) is not KEEP}

    def out(self, names: tuple[str, ...]) -> tuple[Any, ...]:
        """The tuple Gradio takes for an event whose outputs are ``names``, in that order.

        Raises ``ValueError`` when the update sets a component the event does not output:
        a handler and its wiring that disagree fail loudly instead of drawing into the
        wrong component.
        """
        import gradio as gr

        extra = set(self.changed()) - set(names)
        if extra:
            raise ValueError(f"this update sets {sorted(extra)}, which its event does not output ({names})")
        return tuple(gr.skip() if (v := getattr(self, n)) is KEEP else v for n in names)

    def value(self, names: tuple[str, ...]) -> Any:
        """What a handler hands Gradio: :meth:`out`, or its one item for an event with one output
        (Gradio takes what such a handler returns as that output's value, a tuple included)."""
        out = self.out(names)
        return out[0] if len(names) == 1 else out


# Each event's outputs, in the order the layout wires them.
VIEW = ("chat", "turn", "summary", "map", "growth", "teh")  # what the page draws of its session
LOAD = ("state", "status", *VIEW, "timer", "alert", "seen")  # the timer runs only while the model loads
TICK = LOAD
SYNC = ("seen", "alert", *VIEW, "status")
TURN = ("state", "chat", "textbox", "alert", *VIEW[1:], "status", "seen")  # Send, Enter, Regenerate
EDIT_TURN = (*TURN, "edit_turn")  # an edited message resent
STOP = ("chat", "alert", *VIEW[1:], "textbox")  # the box takes back what still waited (app.handlers.waiting)
QUEUE = ("textbox", "chat", "alert")  # Send and Enter, at once: the message shown waiting
VERSION = ("chat", "alert", *VIEW[1:])  # ‹ and › under the last reply
NEW_CHAT = ("state", "alert", *VIEW, "seen")
RECOLOUR = ("map",)
STORED = ("stored",)
SELECT = ("chosen",)
LIST = ("table", "sessions_note")
RESUME = ("state", "sessions_note", *VIEW, "tabs", "alert", "seen")
FILE = ("download", "files_note")  # Save .miku, Export
ASK_DELETE = ("pending", "sessions_note", "confirm", "cancel")
CONFIRM_DELETE = ("table", "sessions_note", "pending", "confirm", "cancel")
UPLOAD = ("state", "files_note", *VIEW, "table", "tabs", "alert", "seen")
EXPLORE = ("ex_steps", "ex_plot", "mcb")
CHATS = ("chats", "chat_title")  # the sidebar's list of chats, and the open one's title
OPEN_CHAT = ("state", "alert", *VIEW, *CHATS, "seen")
RENAME = (*CHATS, "alert")
ASK_DELETE_CHAT = ("chat_confirm", "chat_cancel", "alert")
DELETE_CHAT = ("state", "alert", *VIEW, *CHATS, "chat_confirm", "chat_cancel", "seen")
