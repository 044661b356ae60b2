"""The page's layout and its wiring: which components each handler of :class:`app.ui.WebUI`
reads and updates (:func:`build_blocks`), the page's CSS, and the wrapper that hands a
handler its request. Built inside ``create_app`` only, never at import time.
"""

from __future__ import annotations

import json
from typing import Any, TypedDict

from isagi.app import updates as u
from isagi.app.handlers.chat import SYNC_S
from isagi.app.handlers.page import LOGOUT
from isagi.app.help_text import help_markdown
from isagi.app.render_safe import LATEX_DELIMITERS
from isagi.app.ui import WebUI
from isagi.app.views import turn_markdown

GRADIO_CACHE_DELETE = (60, 600)  # Gradio's copies of downloads: every minute, those older than 10 minutes
# An event with no API endpoint (private): Gradio takes api_name=False for it (on Gradio 5 the only
# way) but annotates the parameter ``str | None``, so its annotation is overridden here, once.
NO_API: str = False  # type: ignore[assignment]


class _Queue(TypedDict, total=False):
    """How an event waits in Gradio's queue (its concurrency keywords)."""

    concurrency_id: str
    concurrency_limit: int

# Every colour of the page's own is either a theme variable (it follows light and dark) or
# white text on a badge colour dark enough for 4.5:1 in both themes (WCAG AA, checked by
# tests/e2e/test_look_browser.py). Gradio's own subdued text, orange accent and button colours
# fall short of 4.5:1 (light grey on white, white on orange-500): they are set one step darker. Gradio's bundled "Source Sans Pro" semibold (600) file holds a
# handful of glyphs only: a semibold word was drawn in the system's bold with a few letters of the
# real font among them (the small "A" of "ISAGI"); 600 is served from the complete bold file.
CSS = """
:root { --body-text-color-subdued: #52525b; --color-accent: #c2410c;
  --button-primary-background-fill: #c2410c; --button-primary-background-fill-hover: #9a3412;
  --button-cancel-background-fill: #b91c1c; --button-cancel-background-fill-hover: #991b1b; }
.dark { --body-text-color-subdued: #a1a1aa;
  --button-primary-background-fill: #c2410c; --button-primary-background-fill-hover: #9a3412;
  --button-cancel-background-fill: #b91c1c; --button-cancel-background-fill-hover: #991b1b; }
@font-face { font-family: 'Source Sans Pro'; font-weight: 600; font-style: normal;
  src: url('static/fonts/SourceSansPro/SourceSansPro-Bold.woff2') format('woff2'); }
.isagi-info { font-size: 0.85em; color: var(--body-text-color-subdued); line-height: 1.6; }
.isagi-tier { display: inline-block; padding: 1px 8px; border-radius: 10px; color: #fff;
  font-weight: 600; font-size: 0.85em; letter-spacing: 0.03em; margin-right: 4px; }
.isagi-tier-retrieve { background: #187a3f; }
.isagi-tier-augment { background: #1f6aa0; }
.isagi-tier-expand { background: #7b3294; }
.isagi-tier-explore { background: #b34d00; }
.isagi-tier-refused, .isagi-tier-withheld { background: #b2182b; }
.isagi-tier-cancelled { background: #666; }
.isagi-tier-pending { background: #5f6b7a; }
.isagi-info [title], .isagi-tier[title] { cursor: help; }
#isagi-sessions th, #isagi-sessions th * { white-space: nowrap; word-break: keep-all; overflow-wrap: normal; }
#isagi-alert p { color: #b2182b; font-weight: 600; }
.dark #isagi-alert p { color: #ff8a8a; }
#isagi-status p { font-size: 0.95em; }
.isagi-math { overflow-x: auto; max-width: 100%; }
div.isagi-math { margin: 0.5em 0; }
/* the figures are transparent (app.plots): in dark mode their texts and grid follow the page */
.dark .js-plotly-plot .main-svg text:not(.hoverlayer *) { fill: var(--body-text-color) !important; }
.dark .js-plotly-plot .gridlayer path, .dark .js-plotly-plot .zerolinelayer path { stroke: #3a4250 !important; }
.dark .js-plotly-plot .legend .bg { fill: transparent !important; }
/* Gradio fades a hidden progress tracker out but keeps its running timer ("0.1s") inside every
   output of an event: screen readers, copy and innerText read it as the output's text */
[data-testid=status-tracker].hide { display: none !important; }
/* Stop is drawn faded while nothing generates or waits (it still answers: "Nothing was generating") */
#isagi-stop { transition: opacity 0.15s; }
body:not(:has(#isagi-chat .isagi-generating, #isagi-chat .isagi-waiting)) #isagi-stop { opacity: 0.45; }
"""

# The chat list (the sidebar): its radio drawn as a list of rows, one chat a row, the open one marked.
CHATS_CSS = """
#isagi-chats .wrap { display: flex; flex-direction: column; gap: 2px; }
#isagi-chats label { width: 100%; box-sizing: border-box; margin: 0; cursor: pointer; }
#isagi-chats label span { overflow: hidden; text-overflow: ellipsis; white-space: nowrap; }
#isagi-chats input[type=radio] { display: none; }
#isagi-chats label.selected, #isagi-chats label:has(input:checked) {
  font-weight: 600; border-color: var(--color-accent); background: var(--color-accent-soft); }
.isagi-raw { display: none; }
.isagi-actions { display: flex; gap: 6px; justify-content: flex-end; margin-top: 2px; }
.isagi-msg-action { border: none; background: none; cursor: pointer; padding: 0 2px; font-size: 0.78em;
  color: var(--body-text-color-subdued); }
.isagi-msg-action:hover, .isagi-msg-action:focus-visible { color: var(--body-text-color); text-decoration: underline; }
.isagi-copy::before { content: "Copy"; }
.isagi-copy.isagi-copied::before { content: "Copied"; }
.isagi-edit::before { content: "Edit"; }
.isagi-versions { margin-left: 6px; white-space: nowrap; }
.isagi-versions button { border: none; background: none; cursor: pointer; padding: 0 4px; font-size: 1.1em;
  color: var(--body-text-color); }
#isagi-editing { font-size: 0.9em; color: var(--body-text-color-subdued); padding: 2px 4px; }
"""

# A message sent that waits for the model (app.handlers.waiting): greyed, saying so.
WAITING_CSS = """
.isagi-waiting { opacity: 0.6; }
.isagi-waiting-note { font-size: 0.85em; font-style: italic; margin-top: 2px; }
"""


def page_css() -> str:
    """The page's CSS: :data:`CSS` and the code colours of both themes (made here, not at import)."""
    from isagi.app.render_safe import code_css

    return CSS + CHATS_CSS + WAITING_CSS + code_css()


# Esc stops the reply, as in the chat pages people know: a click on Stop (the same event, the
# same wait), from anywhere on the page, unless something else (a dialog, a dropdown) took the key.
# A chat message's accessible name: Gradio labels each message with its raw content, here the HTML
# rendered on the server; a screen reader would read the tags. The label is set to the text the
# message shows, again whenever Gradio sets it (a streamed reply, a redrawn chat).
ESC_AND_LABELS = """<script>
document.addEventListener('keydown', (e) => {
  if (e.key !== 'Escape' || e.defaultPrevented) return;
  const stop = document.querySelector('#isagi-stop');
  if (stop && !stop.disabled) stop.click();
});
(() => {
  const who = { user: 'Your message', bot: 'Reply' };
  const label = (el) => {
    const role = el.getAttribute('data-testid');
    const body = el.querySelector('.message-content') || el;
    const copy = body.cloneNode(true);
    copy.querySelectorAll('.katex-mathml, button, svg, .isagi-raw, .isagi-actions').forEach((n) => n.remove());
    const text = (copy.textContent || '').replace(/\\s+/g, ' ').trim();
    const want = (who[role] || 'Message') + ': ' + text;
    if (el.getAttribute('aria-label') !== want) el.setAttribute('aria-label', want);
  };
  const fix = () => document.querySelectorAll('#isagi-chat [data-testid=user][aria-label], '
    + '#isagi-chat [data-testid=bot][aria-label]').forEach(label);
  let queued = false;
  const later = () => { if (!queued) { queued = true; requestAnimationFrame(() => { queued = false; fix(); }); } };
  const start = () => new MutationObserver(later).observe(document.body,
    { subtree: true, childList: true, characterData: true, attributes: true, attributeFilter: ['aria-label'] });
  if (document.body) start(); else document.addEventListener('DOMContentLoaded', start);
})();
</script>"""

# Each message's actions, as chat pages people know have them: Copy on every message (a reply:
# its text as shown; a question: exactly as sent), and Edit on the user's own (the message goes
# back into the box, a line says what Send will do, Esc cancels; Send then resends it through the
# hidden #isagi-edit-send event, which cuts the chat at that turn). The buttons' words are CSS
# content, so they are not part of a message's text; the page redraws them whenever Gradio
# redraws the chat.
MESSAGE_ACTIONS = r"""<script>
(() => {
  let editing = null;
  const q = (sel) => document.querySelector(sel);
  const field = (id) => q(id + ' textarea') || q(id + ' input');
  const put = (el, value) => { if (!el) return; el.value = value; el.dispatchEvent(new Event('input', { bubbles: true })); };
  const line = () => {
    let d = q('#isagi-editing');
    if (!d) {
      const input = q('#isagi-input');
      const row = input && (input.closest('.row') || input.parentElement);  // the box and Send's row: the line goes above it
      if (!row || !row.parentElement) return null;
      d = document.createElement('div');
      d.id = 'isagi-editing';
      d.setAttribute('role', 'status');
      row.parentElement.insertBefore(d, row);
    }
    return d;
  };
  const cancel = () => {
    editing = null;
    put(field('#isagi-edit-turn'), '');
    const d = q('#isagi-editing');
    if (d) d.remove();
  };
  const edit = (frame) => {
    const turn = [...frame.classList].map((c) => c.match(/^isagi-turn-(\d+)$/)).find((m) => m);
    const raw = frame.querySelector('.isagi-raw');
    if (!turn || !raw) return;
    editing = turn[1];
    put(field('#isagi-edit-turn'), editing);
    const box = field('#isagi-input');
    put(box, raw.textContent);
    const d = line();
    if (d) d.textContent = 'Editing your message ' + (Number(editing) + 1)
      + ': Send replaces it and every message after it. Esc cancels.';
    if (box) { box.focus(); box.setSelectionRange(box.value.length, box.value.length); }
  };
  const resend = () => { const b = q('#isagi-edit-send'); if (b) b.click(); setTimeout(cancel, 0); };
  const copy = (text, button) => {
    const done = () => { button.classList.add('isagi-copied'); setTimeout(() => button.classList.remove('isagi-copied'), 1500); };
    if (navigator.clipboard && window.isSecureContext) {
      navigator.clipboard.writeText(text).then(done, () => {});
    } else {
      const t = document.createElement('textarea');
      t.value = text; document.body.appendChild(t); t.select();
      try { document.execCommand('copy'); done(); } finally { t.remove(); }
    }
  };
  const button = (cls, label, act) => {
    const b = document.createElement('button');
    b.type = 'button'; b.className = 'isagi-msg-action ' + cls;
    b.setAttribute('aria-label', label); b.title = label;
    b.addEventListener('click', (e) => { e.preventDefault(); e.stopPropagation(); act(b); });
    return b;
  };
  const decorate = () => {
    document.querySelectorAll('#isagi-chat [data-testid=user] .message-content, '
      + '#isagi-chat [data-testid=bot] .message-content').forEach((body) => {
      if (body.querySelector('.isagi-info')) return;
      const frame = body.querySelector('.isagi-user');
      // a message drawn again in the same place (a waiting one become its turn) gets its bar anew
      const kind = frame ? frame.className : 'reply';
      const old = body.querySelector(':scope > .isagi-actions');
      if (old && old.dataset.kind === kind) return;
      if (old) old.remove();
      const text = () => frame ? frame.querySelector('.isagi-raw').textContent : body.innerText.trim();
      if (!frame && !body.innerText.trim()) return;
      const bar = document.createElement('div');
      bar.className = 'isagi-actions';
      bar.dataset.kind = kind;
      bar.appendChild(button('isagi-copy', frame ? 'Copy your message' : 'Copy the reply', (b) => copy(text(), b)));
      if (frame && [...frame.classList].some((c) => c.startsWith('isagi-turn-'))) {
        bar.appendChild(button('isagi-edit', 'Edit and resend your message', () => edit(frame)));
      }
      body.appendChild(bar);
    });
  };
  // Enter and Send resend an edited message; Esc cancels the edit (before Esc's Stop sees it)
  document.addEventListener('keydown', (e) => {
    if (editing === null) return;
    if (e.key === 'Escape') { e.preventDefault(); cancel(); return; }
    if (e.key === 'Enter' && !e.shiftKey && !e.isComposing && e.target === field('#isagi-input')) {
      e.preventDefault(); e.stopPropagation(); resend();
    }
  }, true);
  document.addEventListener('click', (e) => {
    if (editing !== null && e.target.closest && e.target.closest('#isagi-send')) {
      e.preventDefault(); e.stopPropagation(); resend();
    }
  }, true);
  // What a Send or an Enter sends is the box's text at that moment: Gradio reads its own copy
  // of the box later, when the next text may already be typed (or pasted) in. TAKE_MESSAGE takes
  // these in order.
  window.isagiTyped = [];
  document.addEventListener('keydown', (e) => {
    const box = field('#isagi-input');
    if (editing === null && e.key === 'Enter' && !e.shiftKey && !e.isComposing && box && e.target === box) {
      window.isagiTyped.push(box.value);
    }
  }, true);
  document.addEventListener('click', (e) => {
    const box = field('#isagi-input');
    if (editing === null && box && e.target.closest && e.target.closest('#isagi-send')) window.isagiTyped.push(box.value);
  }, true);
  // ‹ and › under the last reply: the hidden events that switch its version
  document.addEventListener('click', (e) => {
    const arrow = e.target.closest && e.target.closest('#isagi-chat .isagi-version-prev, #isagi-chat .isagi-version-next');
    if (!arrow) return;
    e.preventDefault();
    const b = q(arrow.classList.contains('isagi-version-prev') ? '#isagi-version-prev' : '#isagi-version-next');
    if (b) b.click();
  });
  let queued = false;
  const later = () => { if (!queued) { queued = true; requestAnimationFrame(() => { queued = false; decorate(); }); } };
  const start = () => new MutationObserver(later).observe(document.body, { subtree: true, childList: true });
  if (document.body) start(); else document.addEventListener('DOMContentLoaded', start);
})();
</script>"""

SERVER_GONE_TEXT = "The ISAGI server has stopped; reload when it is back."
SERVER_GONE_WATCH_TRIES = 30  # once something looks wrong, /health is asked once a second this many times
# A tab whose server stopped says so in a banner (Gradio's own notice comes only when an event
# fails, and not always). Nothing is polled while Gradio's requests and event streams end as
# Gradio ends them. Two things make the page ask /health, once a second, up to
# SERVER_GONE_WATCH_TRIES times after the last of them (the server may still answer for a moment
# while it stops); no answer at all shows the banner, any answer (even an error status) nothing:
# - a request of the page to Gradio fails without an answer (the page's own timer sends one
#   every few seconds);
# - one of Gradio's event streams (queue/data) ends without Gradio's own close_stream message,
#   i.e. it was cut, as the server cuts them when it stops. This one is needed: an event sent as
#   the server stops (a timer tick) never completes, and Gradio sends no further tick while one
#   is pending, so no later request would fail.
# Behind a balancer another replica answers /health, so no banner comes there (the tab must be
# reloaded to go on, on the replica that answers).
SERVER_GONE = """<script>
(() => {
  const realFetch = window.fetch.bind(window);
  const health = new URL('health', window.location.href.split(/[?#]/)[0]).href;
  let shown = false;
  const show = () => {
    if (shown) return;
    shown = true;
    const d = document.createElement('div');
    d.id = 'isagi-gone';
    d.setAttribute('role', 'alert');
    d.textContent = TEXT;
    d.style.cssText = 'position:fixed;top:0;left:0;right:0;z-index:10000;padding:10px 16px;'
      + 'background:#b2182b;color:#fff;font-weight:600;text-align:center;';
    document.body.appendChild(d);
  };
  const answers = () => realFetch(health, {cache: 'no-store'}).then(() => true, () => false);
  let left = 0, watching = false;  // the /health checks still to come
  const watch = () => {
    if (shown) return;
    if (left-- <= 0) { watching = false; return; }
    answers().then((up) => { if (!up) show(); else setTimeout(watch, 1000); });
  };
  const suspect = () => { left = WATCH_TRIES; if (!watching) { watching = true; watch(); } };
  const watchStream = (response) => {
    if (!response.ok || !response.body) return;
    const reader = response.clone().body.getReader();
    const decoder = new TextDecoder();
    let tail = '', closed = false;
    const ended = () => { if (!closed) suspect(); };
    const read = () => reader.read().then(({done, value}) => {
      if (done) return ended();
      tail = (tail + decoder.decode(value, {stream: true})).slice(-100);
      if (tail.includes('"msg":"close_stream"')) closed = true;
      return read();
    }, ended);
    read();
  };
  window.fetch = (input, init) => {
    const url = typeof input === 'string' ? input : (input && input.url) || String(input);
    const sent = realFetch(input, init);
    if (url.includes('/gradio_api/')) sent.catch(suspect);
    if (url.includes('/gradio_api/queue/data')) sent.then(watchStream, () => {});
    return sent;
  };
})();
</script>""".replace("TEXT", json.dumps(SERVER_GONE_TEXT)).replace("WATCH_TRIES", str(SERVER_GONE_WATCH_TRIES))

# Send and Enter take the message out of the box in the browser, as they fire (the handler gets
# it): the box is empty at once, and an answer arriving later never wipes what is typed next.
# The text is the one the page's script noted at the key or click itself (MESSAGE_ACTIONS'
# isagiTyped): two Enters close together otherwise both read Gradio's later copy of the box,
# and the first message was lost (a second run sent an empty one).
TAKE_MESSAGE = """(message, sid) => {
  const typed = window.isagiTyped && window.isagiTyped.length ? window.isagiTyped.shift() : message;
  const box = document.querySelector('#isagi-input textarea');
  if (box && typeof typed === 'string' && typed.trim() && box.value === typed) {
    box.value = '';
    box.dispatchEvent(new Event('input', { bubbles: true }));
  }
  return [typed, sid];
}"""

HEAD = ESC_AND_LABELS + MESSAGE_ACTIONS + SERVER_GONE


def _low_end(usual: int, cap: int) -> int:
    """A token slider's low end: ``usual``, below the server's cap ``cap`` (Gradio needs low < high)."""
    return max(0, min(usual, cap - 1))


def with_request(fn: Any, names: list[str], outputs: tuple[str, ...] | None, *fixed: Any) -> Any:
    """``fn`` as a Gradio handler taking inputs ``names`` and the request (as ``request=``), its
    :class:`~app.updates.PageUpdate` values turned into the tuple of the event's ``outputs``.

    Gradio hands the request only to a positional parameter typed ``gr.Request``;
    this module's annotations are strings (no Gradio at import time), so the
    wrapper carries the signature and the real type. ``fixed`` arguments go
    between the inputs and the request (e.g. an export format). ``outputs`` None: an
    event that outputs nothing.
    """
    import inspect

    import gradio as gr

    n = len(names)

    def shown(update: Any) -> Any:
        return update.value(outputs) if outputs is not None else update

    if inspect.isgeneratorfunction(fn):
        def handler(*args: Any) -> Any:
            for update in fn(*args[:n], *fixed, request=args[n] if len(args) > n else None):
                yield shown(update)
    else:
        def handler(*args: Any) -> Any:
            return shown(fn(*args[:n], *fixed, request=args[n] if len(args) > n else None))
    kind = inspect.Parameter.POSITIONAL_OR_KEYWORD
    handler.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
        [inspect.Parameter(x, kind) for x in names] + [inspect.Parameter("request", kind)]
    )
    handler.__annotations__ = {"request": gr.Request}
    handler.__name__ = getattr(fn, "__name__", "handler")
    handler.__doc__ = getattr(fn, "__doc__", None)
    return handler


def build_blocks(ui: WebUI) -> Any:
    """The page. Call inside ``create_app`` only (never at import time).

    Every handler gets the request (its owner); events not meant for API use
    are private (``api_name=False``: :data:`NO_API`): hidden from the API page, though still
    callable by ``fn_index``, so the owner check is in each handler anyway.
    """
    import gradio as gr

    s = ui.page.settings
    chat_h, history_h, files_h, chats_h = ui.chat, ui.history, ui.files, ui.chats
    R = with_request  # noqa: N806 - a short local alias for the wiring below
    # Model work: one event per sequence slot of the model runs (ISAGI_PARALLEL), one more waits
    # at the engine with its message checked; the rest wait in Gradio's queue, which shows
    # each browser its position.
    model_q: _Queue = {"concurrency_id": "model", "concurrency_limit": s.slots + 1}
    light_q: _Queue = {"concurrency_limit": 8}
    with gr.Blocks(title="ISAGI — living-model chat", fill_width=True, analytics_enabled=False,
                   delete_cache=GRADIO_CACHE_DELETE) as demo:
        # A closed tab's state (Gradio drops it an hour after the tab closed): its session is saved
        # and parked, not forgotten, so a page that has reopened it since (a reload) resumes it
        # from its file under the same id.
        def park(sid: str | None) -> None:
            if sid:
                ui.page.sessions.release(sid, None)  # the server's own: a failed save is logged, kept live

        state = gr.State(None, delete_callback=park)
        # The same id in the browser's storage, read at page load: a reload reopens the session.
        # The storage key and "secret" are fixed so a restarted server still reads it; the secret
        # is sent to the page (Gradio's obfuscation, not a protection): the server trusts the
        # id no more than any other input (owner checks in every handler).
        stored = gr.BrowserState(None, storage_key="isagi-session-id", secret="isagi-session-id-v1")
        seen = gr.State(None)  # what the page has drawn of its session (Page.seen), for its sync
        pending_delete = gr.State(None)  # the session id a Delete waits to have confirmed
        # The chat list: the caller's chats, newest first; one click opens one (app.handlers.chats).
        with gr.Sidebar(open=True, label="Chats", elem_id="isagi-sidebar"):
            side_new = gr.Button("New chat", variant="primary", elem_id="isagi-sidebar-new")
            chats_query = gr.Textbox(label="Search chats", placeholder="Words in a title or a message",
                                     elem_id="isagi-chats-search", max_lines=1)
            chat_title = gr.Textbox(label="This chat's title (Enter renames it)", max_lines=1,
                                    elem_id="isagi-chat-title")
            delete_chat = gr.Button("Delete this chat", variant="stop", size="sm", elem_id="isagi-chat-delete")
            with gr.Row():
                chat_confirm = gr.Button("Yes, delete", variant="stop", size="sm", visible=False,
                                         elem_id="isagi-chat-delete-confirm")
                chat_cancel = gr.Button("Cancel", size="sm", visible=False, elem_id="isagi-chat-delete-cancel")
            chats = gr.Radio(choices=[], label="Your chats", elem_id="isagi-chats")
        gr.Markdown("## ISAGI — a chat model whose memory lives on a manifold")
        with gr.Row(equal_height=True):
            status = gr.Markdown(ui.page.status_line(), elem_id="isagi-status")
            # with a login: Gradio's /logout for this browser only, in this tab (a link in the
            # markdown would open a new one); the banner says who is signed in (Page.signed_in)
            gr.Button("Log out", link=LOGOUT, link_target="_self", size="sm", scale=0, min_width=90,
                      visible=bool(s.auth), elem_id="isagi-logout")
        # The loading banner's timer starts stopped: a page's load starts it while the model
        # still loads. Started in the page's config, a page opened long after the model was ready
        # would still tick once, and that late tick (queued behind other events) reopened the
        # session the page had shown two seconds before, over a New chat or an upload.
        timer = gr.Timer(2.0, active=False)
        sync_timer = gr.Timer(SYNC_S)
        with gr.Tabs(selected="chat") as tabs:
            with gr.Tab("Chat", id="chat"), gr.Row(equal_height=False):
                with gr.Column(scale=5, min_width=420):
                    chat = gr.Chatbot(
                        label="Conversation", elem_id="isagi-chat", height=520,
                        # texts arrive as HTML rendered on the server (render_text); a message's own
                        # copy button would copy that HTML, so code blocks carry their own instead
                        render_markdown=False, sanitize_html=True, buttons=[],
                        # maths: only the delimiters render_text writes around the $…$ it found
                        latex_delimiters=LATEX_DELIMITERS,
                        feedback_options=None, layout="bubble",
                        placeholder="Ask anything. Ask the same question again and it is answered from memory.",
                    )
                    alert = gr.Markdown("", elem_id="isagi-alert")
                    with gr.Row():
                        msg = gr.Textbox(
                            placeholder=f"Message (up to {s.max_message_chars:,} characters) — Enter sends",
                            label="Message", show_label=False, lines=1, max_lines=8, scale=8, elem_id="isagi-input",
                            autofocus=True, interactive=False,
                        )
                        send = gr.Button("Send", variant="primary", scale=1, elem_id="isagi-send",
                                         interactive=False)
                        send_api = gr.Button("Send (API)", visible=False)  # /send's event: API clients only
                    # Edit's state: the turn being edited, and the event that resends it (the page's
                    # script fills the one and clicks the other: MESSAGE_ACTIONS)
                    edit_turn = gr.Textbox(visible="hidden", elem_id="isagi-edit-turn", label="Turn being edited")
                    edit_send = gr.Button("Resend edited", visible="hidden", elem_id="isagi-edit-send")
                    version_prev = gr.Button("Previous version", visible="hidden", elem_id="isagi-version-prev")
                    version_next = gr.Button("Next version", visible="hidden", elem_id="isagi-version-next")
                    with gr.Row():
                        stop = gr.Button("Stop", variant="stop", elem_id="isagi-stop")
                        regen = gr.Button("Regenerate", elem_id="isagi-regen")
                        # extends a reply cut at the token limit (anything else: an alert says so)
                        cont = gr.Button("Continue", elem_id="isagi-continue")
                        new = gr.Button("New chat", elem_id="isagi-new")
                    with gr.Accordion("Generation settings", open=False):
                        # the server's limit (ISAGI_MAX_NEW_TOKENS) is the slider's end: the engine
                        # clamps any request to it, so the page offers no more than it gets
                        max_tokens = gr.Slider(_low_end(8, s.max_new_tokens), s.max_new_tokens, value=s.max_new_tokens,
                                               step=1 if s.max_new_tokens < 64 else 8,
                                               label="Max new tokens", elem_id="isagi-max-tokens")
                        sample = gr.Checkbox(False, label="Sample (otherwise greedy)")
                        temperature = gr.Slider(0.1, 1.5, value=0.7, step=0.05, label="Temperature")
                with gr.Column(scale=4, min_width=380):
                    turn = gr.Markdown(turn_markdown(None), elem_id="isagi-turn")
                    with gr.Accordion("What do these mean?", open=False, elem_id="isagi-help"):
                        gr.Markdown(help_markdown())
                    summary = gr.Markdown("Trajectories: **0**", elem_id="isagi-manifold-summary")
                    colour_by = gr.Radio(["tier", "cluster"], value="tier", label="Colour the map by",
                                         elem_id="isagi-colour")
                    map_plot = gr.Plot(label="Trajectory map", elem_id="isagi-map")
                    growth_plot = gr.Plot(label="Metric growth", elem_id="isagi-growth")
                    teh_plot = gr.Plot(label="TEH", elem_id="isagi-teh")
            with gr.Tab("Sessions", id="sessions") as sessions_tab:
                gr.Markdown("Your past sessions from the history store (with a login, each user sees "
                            "only their own). Every session autosaves its living state; resume one to "
                            "continue it with its memory and metric.")
                with gr.Row():
                    query = gr.Textbox(placeholder="Search message text…", label="Search sessions", show_label=False,
                                       scale=6,
                                       elem_id="isagi-search")
                    refresh = gr.Button("Search / refresh", scale=1, elem_id="isagi-refresh")
                table = gr.Dataframe(headers=["id", "title", "turns", "updated (UTC)", "state"],
                                     interactive=False, wrap=True, elem_id="isagi-sessions")
                sessions_note = gr.Markdown("")
                chosen = gr.Textbox(label="Selected session id", elem_id="isagi-chosen")
                with gr.Row():
                    resume = gr.Button("Resume", variant="primary", elem_id="isagi-resume")
                    export_md = gr.Button("Export Markdown", elem_id="isagi-export-md")
                    export_js = gr.Button("Export JSON", elem_id="isagi-export-json")
                    delete = gr.Button("Delete from history", variant="stop", elem_id="isagi-delete")
                with gr.Row():
                    confirm_delete = gr.Button("Yes, delete", variant="stop", visible=False,
                                               elem_id="isagi-delete-confirm")
                    cancel_delete = gr.Button("Cancel", visible=False, elem_id="isagi-delete-cancel")
                gr.Markdown("### The open session's living state (`.miku`)")
                with gr.Row():
                    save = gr.Button("Save .miku", elem_id="isagi-save")
                    upload = gr.File(label="Load a .miku", file_types=[".miku"], file_count="single",
                                     elem_id="isagi-upload", height=120)
                download = gr.File(label="Download", interactive=False, elem_id="isagi-download")
                files_note = gr.Markdown("", elem_id="isagi-files-note")
            with gr.Tab("Concept explorer", id="explore"):
                gr.Markdown(
                    "Safe OGD concept exploration: a chain of steps from a seed, each steered by "
                    "α·P_safe·v (never along a forbidden direction), with the TEH of every step and "
                    "the MIKU creativity index of the chain. Uses the model: it waits its turn in the queue."
                )
                with gr.Row():
                    seed = gr.Textbox(label="Seed concept", placeholder="e.g. the ocean", scale=4,
                                      elem_id="isagi-seed")
                    steps = gr.Slider(1, 6, value=3, step=1, label="Steps", scale=2)
                    ex_tokens = gr.Slider(_low_end(16, s.max_new_tokens), min(128, s.max_new_tokens),
                                          value=min(40, s.max_new_tokens), step=1 if s.max_new_tokens < 64 else 8,
                                          label="Tokens per step", scale=2)
                    run_ex = gr.Button("Run the explorer", variant="primary", scale=1, elem_id="isagi-explore")
                mcb_md = gr.Markdown("", elem_id="isagi-mcb")
                ex_plot = gr.Plot(label="TEH per step")
                ex_steps = gr.Markdown("", elem_id="isagi-steps")

        # Each handler names what it changes (app.updates.PageUpdate); an event's outputs are the
        # components of one of app.updates' output lists, in that order.
        components = {
            "state": state, "chat": chat, "textbox": msg, "alert": alert, "turn": turn, "summary": summary,
            "map": map_plot, "growth": growth_plot, "teh": teh_plot, "status": status, "seen": seen,
            "timer": timer, "stored": stored, "table": table, "chosen": chosen, "sessions_note": sessions_note,
            "pending": pending_delete, "confirm": confirm_delete, "cancel": cancel_delete,
            "download": download, "files_note": files_note, "tabs": tabs,
            "ex_steps": ex_steps, "ex_plot": ex_plot, "mcb": mcb_md,
            "chats": chats, "chat_title": chat_title, "chat_confirm": chat_confirm, "chat_cancel": chat_cancel,
            "edit_turn": edit_turn,
        }

        def out(names: tuple[str, ...]) -> list[Any]:
            return [components[n] for n in names]

        gen_in = [max_tokens, sample, temperature, colour_by]
        # the chat list as it is now: redrawn after whatever may change it (a turn, a switch, a load)
        list_chats = R(chats_h.list_chats, ["sid", "query"], u.CHATS)

        def relist(event: Any) -> None:
            event.then(list_chats, [state, chats_query], out(u.CHATS), api_name=NO_API, show_progress="hidden",
                       **light_q)

        # The input opens once the load has set the page's session (a message sent before that
        # would be undone by the load's answer), and only when the model can answer (input_open):
        # while it loads, the banner's timer's tick opens it once it is ready.
        demo.load(R(chat_h.on_load, ["sid", "colour_by"], u.LOAD), [stored, colour_by], out(u.LOAD),
                  api_name=NO_API, **light_q
                  ).then(ui.page.input_open, None, [msg, send], api_name=NO_API, queue=False
                  ).then(list_chats, [state, chats_query], out(u.CHATS), api_name=NO_API, **light_q)
        # Whatever sets the page's session (load, a message, New chat, Resume, an upload) keeps it
        # in the browser; None (none yet) leaves the stored id (Gradio writes only a value). The
        # registry learns which page shows it; a closed page's session is parked (unload).
        state.change(R(chat_h.page_shows, ["sid"], u.STORED), state, out(u.STORED), api_name=NO_API, queue=False)
        demo.unload(R(ui.waiting.page_closed, [], None))
        # Another tab of this browser may change the session: the page redraws it when it is stale.
        sync_timer.tick(R(chat_h.sync_with_status, ["sid", "seen", "colour_by"], u.SYNC), [state, seen, colour_by],
                        out(u.SYNC), show_progress="hidden", api_name=NO_API, **light_q)
        tick = timer.tick(R(chat_h.on_tick, ["sid", "colour_by"], u.TICK), [state, colour_by], out(u.TICK),
                          show_progress="hidden", api_name=NO_API, **light_q)
        tick.then(ui.page.input_open, None, [msg, send], api_name=NO_API, queue=False)
        relist(tick)
        send_fn = R(chat_h.send, ["message", "sid", "max_tokens", "sample", "temperature", "colour_by"], u.TURN)
        # Send and Enter: the message is shown at once, greyed, waiting for the model (not queued
        # in Gradio, so neither a streaming reply nor other users' turns delay it), then one run
        # in the model's queue sends every message the page has waiting, in order
        # (app.handlers.waiting). "always_last": a second Enter during that run is taken by it,
        # or by one more run after it, never dropped. A turn's timer shows on the chat only: shown
        # over every output, it read as an alert in the alert line and as noise on the panels.
        waiting_h = ui.waiting
        ev_send = gr.on([send.click, msg.submit], R(waiting_h.queue, ["message", "sid"], u.QUEUE), [msg, state],
                        out(u.QUEUE), api_name=NO_API, queue=False, show_progress="hidden", js=TAKE_MESSAGE,
                        trigger_mode="multiple",
                        ).then(R(waiting_h.send_waiting, ["sid", "max_tokens", "sample", "temperature", "colour_by"],
                                 u.TURN),
                               [state, *gen_in], out(u.TURN), show_progress="minimal", show_progress_on=chat,
                               api_name=NO_API,
                               trigger_mode="always_last", **model_q)
        # one message, one turn, for API clients (/send): the page never triggers it
        ev_api_send = send_api.click(send_fn, [msg, state, *gen_in], out(u.TURN), api_name="send", **model_q)
        relist(ev_send)
        ev_regen = regen.click(R(chat_h.regenerate, ["sid", "max_tokens", "sample", "temperature", "colour_by"],
                                 u.TURN),
                               [state, *gen_in], out(u.TURN), show_progress="minimal", show_progress_on=chat,
                               api_name="regenerate", **model_q)
        relist(ev_regen)
        ev_cont = cont.click(R(chat_h.continue_reply, ["sid", "max_tokens", "sample", "temperature", "colour_by"],
                               u.TURN),
                             [state, *gen_in], out(u.TURN), show_progress="minimal", show_progress_on=chat,
                             api_name="continue_reply", **model_q)
        relist(ev_cont)
        ev_edit = edit_send.click(R(chat_h.edit_send, ["message", "edit_turn", "sid", "max_tokens", "sample",
                                                      "temperature", "colour_by"], u.EDIT_TURN),
                                  [msg, edit_turn, state, *gen_in], out(u.EDIT_TURN), show_progress="minimal",
                                  show_progress_on=chat,
                                  api_name=NO_API, **model_q)
        relist(ev_edit)
        for button, step in ((version_prev, -1), (version_next, 1)):
            button.click(R(chat_h.version, ["sid", "colour_by"], u.VERSION, step), [state, colour_by], out(u.VERSION),
                         api_name=NO_API, show_progress="hidden", **light_q)
        stop.click(R(waiting_h.stop, ["sid", "box_text", "colour_by"], u.STOP), [state, msg, colour_by], out(u.STOP),
                   cancels=[ev_send, ev_api_send, ev_regen, ev_edit, ev_cont], show_progress="hidden", api_name="stop",
                   queue=False)
        new_fn = R(chat_h.new_chat, ["sid", "colour_by"], u.NEW_CHAT)
        relist(new.click(new_fn, [state, colour_by], out(u.NEW_CHAT), api_name="new_chat", **light_q))
        relist(side_new.click(new_fn, [state, colour_by], out(u.NEW_CHAT), api_name=NO_API, **light_q))
        relist(chat.clear(new_fn, [state, colour_by], out(u.NEW_CHAT), api_name=NO_API, **light_q))
        # the sidebar: open a chat by its row, search, rename the open one, delete it (asked first)
        chats.input(R(chats_h.open_chat, ["chosen", "sid", "query", "colour_by"], u.OPEN_CHAT),
                    [chats, state, chats_query, colour_by], out(u.OPEN_CHAT), api_name=NO_API, **light_q)
        chats_query.change(list_chats, [state, chats_query], out(u.CHATS), api_name=NO_API,
                          show_progress="hidden", trigger_mode="always_last", **light_q)
        rename_fn = R(chats_h.rename, ["title", "sid", "query"], u.RENAME)
        gr.on([chat_title.submit, chat_title.blur], rename_fn, [chat_title, state, chats_query], out(u.RENAME),
              api_name=NO_API, **light_q)
        delete_chat.click(R(chats_h.ask_delete, ["sid"], u.ASK_DELETE_CHAT), [state], out(u.ASK_DELETE_CHAT),
                          api_name=NO_API, **light_q)
        chat_confirm.click(R(chats_h.delete, ["sid", "query", "colour_by"], u.DELETE_CHAT),
                           [state, chats_query, colour_by], out(u.DELETE_CHAT), api_name=NO_API, **light_q)
        chat_cancel.click(R(chats_h.cancel_delete, [], u.ASK_DELETE_CHAT), None, out(u.ASK_DELETE_CHAT),
                          api_name=NO_API, queue=False)
        colour_by.change(R(chat_h.recolour, ["sid", "colour_by"], u.RECOLOUR), [state, colour_by],
                         out(u.RECOLOUR), api_name=NO_API, **light_q)

        list_fn = R(history_h.list_sessions, ["query"], u.LIST)
        refresh.click(list_fn, query, out(u.LIST), api_name="list_sessions", **light_q)
        query.submit(list_fn, query, out(u.LIST), api_name=NO_API, **light_q)
        def on_select(evt: Any, rows: Any) -> Any:
            return history_h.select_row(evt, rows).value(u.SELECT)

        on_select.__annotations__ = {"evt": gr.SelectData, "rows": Any}
        table.select(on_select, [table], out(u.SELECT), api_name=NO_API, **light_q)
        relist(resume.click(R(history_h.resume, ["chosen", "sid", "colour_by"], u.RESUME),
                            [chosen, state, colour_by], out(u.RESUME), api_name="resume", **light_q))
        export_md.click(R(history_h.export, ["chosen", "sid"], u.FILE, "markdown"), [chosen, state], out(u.FILE),
                        api_name="export_markdown", **light_q)
        export_js.click(R(history_h.export, ["chosen", "sid"], u.FILE, "json"), [chosen, state], out(u.FILE),
                        api_name="export_json", **light_q)
        delete.click(R(history_h.ask_delete, ["chosen", "sid"], u.ASK_DELETE), [chosen, state],
                     out(u.ASK_DELETE), api_name=NO_API, **light_q)
        confirm_delete.click(R(history_h.confirm_delete, ["pending", "sid"], u.CONFIRM_DELETE),
                             [pending_delete, state], out(u.CONFIRM_DELETE), api_name=NO_API, **light_q)
        cancel_delete.click(lambda: history_h.cancel_delete().value(u.ASK_DELETE), None, out(u.ASK_DELETE),
                            api_name=NO_API, queue=False)
        save.click(R(files_h.save_miku, ["sid"], u.FILE), state, out(u.FILE), api_name="save_miku", **light_q)
        # The box is emptied once the file is read (loaded or refused): it never shows an earlier
        # file beside a later error, and it takes the next file at once.
        upload.upload(R(files_h.load_miku, ["file", "sid", "colour_by"], u.UPLOAD), [upload, state, colour_by],
                      out(u.UPLOAD), api_name="load_miku", **light_q
                      ).then(lambda: None, None, upload, api_name=NO_API, queue=False
                      ).then(list_chats, [state, chats_query], out(u.CHATS), api_name=NO_API, **light_q)

        def explore(seed: str, steps: float, tokens: float) -> tuple[Any, ...]:
            return ui.explorer.run(seed, steps, tokens).value(u.EXPLORE)

        run_ex.click(explore, [seed, steps, ex_tokens], out(u.EXPLORE), api_name="explore", **model_q)
        # opening the tab shows the list as it is now (wired last: earlier events keep their fn_index)
        sessions_tab.select(list_fn, query, out(u.LIST), api_name=NO_API, **light_q)
    return demo
