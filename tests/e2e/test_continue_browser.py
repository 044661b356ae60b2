"""Continue in Chromium (issue 39): a reply cut at the token limit is extended in place.

On the fake engine's live app (its tiny random model never ends a reply before the token limit,
so every generated reply is cut): Continue streams the continuation into the same reply, whose
info line then says "continued"; the chat still has one question, the history store counts two
turns (the reply and its continuation), and a reload shows the same one reply. The question asked again is
answered from memory with the whole reply, which did not stop at a limit: Continue then says
there is nothing to continue.
"""

from __future__ import annotations

import pytest

from tests.e2e.conftest import live_server, open_page, wait_ready
from tests.e2e.test_reload import user_messages
from tests.e2e.test_turns_browser import table_turns
from tests.e2e.test_web_e2e import open_tab, send_and_wait, session_id, set_max_tokens, wait_text

pytestmark = pytest.mark.browser

Q = "How do plants make food?"

# The text of each reply bubble (not the info lines), without the page's action buttons.
_REPLIES = """() => Array.from(document.querySelectorAll('#isagi-chat [data-testid=bot] .message-content'))
  .filter(b => !b.querySelector('.isagi-info'))
  .map(b => { const c = b.cloneNode(true);
              c.querySelectorAll('button, svg, .isagi-actions').forEach(n => n.remove());
              return (c.textContent || '').trim(); })
  .filter(t => t.length)"""
_CONTINUED = """() => { const infos = document.querySelectorAll('#isagi-chat .isagi-info');
  const last = infos[infos.length - 1];
  return !!last && last.innerText.includes('continued') && !last.innerText.includes('generating'); }"""


@pytest.fixture(scope="module")
def url(tmp_path_factory):
    with live_server(tmp_path_factory, fake=True) as u:
        yield u


def replies(page) -> list[str]:
    return page.evaluate(_REPLIES)


def test_continue_extends_a_cut_reply_in_place_and_a_reload_shows_it_as_one(browser, url, screenshot_dir):
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000})
    try:
        page = open_page(ctx, url)
        set_max_tokens(page, 8)
        send_and_wait(page, Q)
        sid = session_id(page)
        (cut,) = replies(page)
        assert cut, "the cut reply is shown"

        page.click("#isagi-continue")
        page.wait_for_function(_CONTINUED, timeout=120_000)
        page.screenshot(path=str(screenshot_dir / "continue-extends-the-reply.png"), full_page=True)
        (whole,) = replies(page)
        assert whole.startswith(cut) and len(whole) > len(cut), (cut, whole)
        assert user_messages(page) == [Q], "the continuation has no question of its own"

        page.reload()
        wait_ready(page)
        wait_text(page, "#isagi-manifold-summary", sid)
        page.wait_for_function(_CONTINUED, timeout=120_000)
        assert replies(page) == [whole] and user_messages(page) == [Q]

        # the memory answers the question again with the whole reply; that answer ended on its
        # own: nothing to continue
        assert send_and_wait(page, Q) == "RETRIEVE"
        assert replies(page)[-1] == whole
        page.click("#isagi-continue")
        wait_text(page, "#isagi-alert", "Nothing to continue")
        assert table_turns(page, sid) == 3, "the reply, its continuation, the answer from memory"
        open_tab(page, "Chat")
    finally:
        ctx.close()
