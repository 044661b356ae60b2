"""Send and Enter as the page does them: a message shows at once, waits its turn, is sent in order.

Enter (or Send) runs two events (:func:`app.layout.build_blocks`). The first,
:meth:`WaitingHandlers.queue`, is not queued in Gradio (it answers at once, whatever the model
is doing; the page has emptied the box as it fired): it checks the message, puts it on the
page's line (:class:`app.outbox.Outbox`) and draws the message in the conversation, greyed, "waiting for the model".
The second, :meth:`WaitingHandlers.send_waiting`, waits in the model's queue and sends what
waits on the page's line, oldest first, one turn after another (:meth:`ChatHandlers.send`),
each replacing its grey entry with the normal turn; while a turn streams, what still waits
stays drawn after it. One such run per page sends (a second finds the first sending and
leaves it the line), so two messages sent during a reply are both answered, in order,
never twice. Stop gives what still waits back to the message box (:meth:`WaitingHandlers.stop`):
nothing is sent that the user stopped, and nothing typed is lost.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from isagi.app.handlers.chat import ChatHandlers, _page_of
from isagi.app.handlers.page import NOT_LOGGED_IN
from isagi.app.loader import EngineLoading
from isagi.app.outbox import Outbox
from isagi.app.updates import KEEP, PageUpdate
from isagi.app.views import chat_window, user_html
from isagi.errors import IsagiError

WAITING_NOTE = "waiting for the model"
FULL = ("Too many messages are waiting for the model already; send this one once a reply has "
        "ended (it stays in the box).")


def waiting_entries(texts: list[str]) -> list[dict[str, str]]:
    """The chat entries of messages that wait: each the user's message, greyed, saying so (framed
    as a sent one, :func:`~app.views.user_html`, so Copy takes it as typed; no turn yet: no Edit)."""
    return [{"role": "user", "content": f'<div class="isagi-waiting">{user_html(t)}'
                                        f'<div class="isagi-waiting-note">{WAITING_NOTE}…</div></div>'}
            for t in texts]


class WaitingHandlers:
    """Send and Enter (module docstring); :attr:`outbox` holds every page's waiting line."""

    def __init__(self, chat: ChatHandlers, outbox: Outbox | None = None) -> None:
        self.chat = chat
        self.page = chat.page
        self.outbox = outbox if outbox is not None else Outbox()

    def queue(self, message: str, sid: str | None, request: Any = None) -> PageUpdate:
        """Put ``message`` on the page's line and show it waiting (outputs :data:`~app.updates.QUEUE`).
        One the engine refuses (empty, too long), or one over the line's
        bound, is put back in the box (the page emptied it as it sent) with an alert saying what to do."""
        p = self.page
        owner, _ = p.who(request)
        if owner is None:
            return PageUpdate(alert=p.warn(NOT_LOGGED_IN))
        if not isinstance(message, str):
            return PageUpdate()
        try:
            p.engine.check(message)  # an empty message too: the alert says what to do
        except (EngineLoading, IsagiError) as exc:
            return PageUpdate(textbox=message, alert=p.warn(str(exc)))
        key = (owner, _page_of(request))
        if not self.outbox.put(key, message):
            return PageUpdate(textbox=message, alert=p.warn(FULL))
        shown = self.outbox.shown(key)
        if shown is None:
            try:
                shown = chat_window(p.sessions.session(sid, owner))
            except (KeyError, EngineLoading):
                shown = []
        # the page emptied the box as it sent (app.layout.TAKE_MESSAGE): what is typed since stays
        return PageUpdate(alert="", chat=[*shown, *waiting_entries(self.outbox.waiting(key))])

    def send_waiting(
        self, sid: str | None, max_tokens: float = 0, sample: bool = False, temperature: float = 0.7,
        colour_by: str = "tier", request: Any = None,
    ) -> Iterator[PageUpdate]:
        """Send what waits on the page's line, oldest first, each as a turn streaming updates of
        :data:`~app.updates.TURN` (the box is never touched: the user may be typing). Another
        run of the page that sends already takes the line: this one changes nothing."""
        owner, _ = self.page.who(request)
        if owner is None:
            yield PageUpdate()
            return
        key = (owner, _page_of(request))
        box = self.outbox
        if not box.claim(key):
            yield PageUpdate()
            return
        held, sent = True, False
        try:
            while (text := box.next(key)) is not None:
                sent = True
                for update in self.chat.send(text, sid, max_tokens, sample, temperature, colour_by, request=request):
                    if update.state is not KEEP:
                        sid = update.state  # a first message makes the session
                    if update.chat is not KEEP:
                        box.remember(key, update.chat)
                        update = update.but(chat=[*update.chat, *waiting_entries(box.waiting(key))])
                    yield update.but(textbox=KEEP)
            held = False
            if not sent:  # Stop took the line back first; a generator that yields nothing would blank
                yield PageUpdate()  # every output (Gradio's "finished iterating" values)
        finally:
            if held:  # left early: Stop's cancel, a closed page, an error
                box.release(key)
            box.remember(key, None)

    def stop(self, sid: str | None, box_text: str, colour_by: str = "tier", request: Any = None) -> PageUpdate:
        """Stop (outputs :data:`~app.updates.STOP`): the messages still waiting go back to the
        message box (before what it holds now) instead of being sent; then the running reply
        stops as :meth:`ChatHandlers.stop` does."""
        owner, _ = self.page.who(request)
        back = self.outbox.take_all((owner, _page_of(request))) if owner is not None else []
        update = self.chat.stop(sid, colour_by, request=request)
        if not back:
            return update
        typed = box_text if isinstance(box_text, str) and box_text.strip() else ""
        note = f"{len(back)} waiting message{'s are' if len(back) != 1 else ' is'} back in the box, not sent."
        alert = update.alert if isinstance(update.alert, str) and update.alert else ""
        return update.but(textbox="\n\n".join([*back, *([typed] if typed else [])]),
                          alert=f"{alert} {note}".strip())

    def page_closed(self, request: Any = None) -> None:
        """The page was closed or reloaded: its waiting messages are dropped, then the page's
        session is left as :meth:`ChatHandlers.page_closed` does (a turn it ran is stopped)."""
        owner, _ = self.page.who(request)
        if owner is not None:
            self.outbox.forget((owner, _page_of(request)))
        self.chat.page_closed(request)
