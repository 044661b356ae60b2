"""No text the page shows makes the browser fetch anything (issue 21), in the real browser
(Debian's Chromium through Playwright) on the fake engine, whose every reply is made to
stream a hostile text (:mod:`tests.e2e.fake_server` ``--reply``).

The hostile texts hold a markdown image, a reference image, an ``<img>`` tag, an
``<svg><image>``, a ``<video poster>``, a prefetch ``<link>``, an ``<iframe>``, a mermaid
diagram with an image in a label, a KaTeX ``\\includegraphics`` and a plain link, each
pointing at a loopback HTTP server of this test (the beacon). They are sent as the
user's message (also the session's title), streamed as a generated reply, streamed
again as a reply answered from memory (RETRIEVE), shown from a saved file loaded back,
and listed in the Sessions table. The beacon and ``page.on("request")`` both see a
control image the test itself adds, and nothing else: zero requests from any text.
"""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import pytest

from tests.e2e.conftest import live_server, open_page, table_rows
from tests.e2e.test_web_e2e import badges, open_tab, reply_count, send, session_id, wait_text

pytestmark = pytest.mark.browser

PNG = bytes.fromhex("89504e470d0a1a0a0000000d4948445200000001000000010806000000"
                    "1f15c4890000000d49444154789c63000100000500010d0a2db40000000049454e44ae426082")


class Beacon:
    """A loopback HTTP server that answers a tiny image and records every path asked."""

    def __init__(self) -> None:
        hits = self.hits = []

        class Handler(BaseHTTPRequestHandler):
            def do_GET(self) -> None:  # noqa: N802 - http.server's name
                hits.append(self.path)
                self.send_response(200)
                self.send_header("Content-Type", "image/png")
                self.send_header("Content-Length", str(len(PNG)))
                self.end_headers()
                self.wfile.write(PNG)

            def log_message(self, *args: Any) -> None:
                pass

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        self.thread = threading.Thread(target=self.server.serve_forever, daemon=True)
        self.thread.start()

    def close(self) -> None:
        self.server.shutdown()
        self.server.server_close()


def hostile(base: str) -> str:
    """A text with every way we know of to make a page fetch ``base/...``, and a plain link."""
    return (
        f"![beacon image]({base}/md.png) <img src=\"{base}/tag.png\"> [a plain link]({base}/link) "
        f"![ref image][r] <svg><image href=\"{base}/svg.png\"/></svg> <video poster=\"{base}/poster.png\"></video> "
        f"<link rel=prefetch href=\"{base}/prefetch\"> <iframe src=\"{base}/frame\"></iframe> "
        f"$$\\includegraphics{{{base}/katex.png}}$$\n\n"
        f"```mermaid\ngraph TD; A[\"<img src='{base}/mermaid.png'>\"]\n```\n\n"
        f"Some **bold** text after it.\n\n[r]: {base}/ref.png\n"
    )


@pytest.fixture(scope="module")
def beacon() -> Iterator[Beacon]:
    b = Beacon()
    try:
        yield b
    finally:
        b.close()


@pytest.fixture(scope="module")
def hostile_url(tmp_path_factory: pytest.TempPathFactory, beacon: Beacon) -> Iterator[str]:
    with live_server(tmp_path_factory, fake=True, fake_args=("--reply", hostile(beacon.url + "/reply"),
                                                                  "--token-delay-s", "0.15")) as url:
        yield url


def test_no_text_on_the_page_makes_the_browser_fetch_anything(hostile_url, beacon, browser, tmp_path,
                                                              screenshot_dir) -> None:
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000}, accept_downloads=True)
    try:
        page = open_page(ctx, hostile_url)
        seen: list[str] = []
        page.on("request", lambda r: seen.append(r.url))
        # the control: a request to the beacon is seen by the beacon and by the page's listener
        page.evaluate("u => { const i = new Image(); i.src = u; document.body.appendChild(i); }",
                      beacon.url + "/control.png")
        for _ in range(100):
            if "/control.png" in beacon.hits:
                break
            page.wait_for_timeout(50)
        assert beacon.hits == ["/control.png"] and [u for u in seen if beacon.url in u] == [beacon.url + "/control.png"]

        # 1. the user's message (the session's title) and a generated reply, seen while it streams
        question = hostile(beacon.url + "/user")
        before = reply_count(page)
        send(page, question)
        streamed = False
        for _ in range(1500):
            chat = page.inner_text("#isagi-chat")
            if "generating" in chat and chat.count("a plain link") >= 2:
                streamed = True  # the partial reply is on the page, rendered, while the turn runs
            if reply_count(page) > before and "generating" not in chat:
                break
            page.wait_for_timeout(20)
        assert streamed, "the hostile reply was not seen while it streamed"
        # 2. the same question: answered from memory, the stored reply streamed again
        before = reply_count(page)
        send(page, question)
        page.wait_for_function("n => Array.from(document.querySelectorAll('#isagi-chat .isagi-info'))"
                               ".filter(e => !e.innerText.includes('generating')).length > n", arg=before)
        assert badges(page)[-1] == "RETRIEVE"
        # 3. saved, and loaded back into a new chat: the stored replies shown from the file
        open_tab(page, "Sessions")
        page.click("#isagi-save")
        page.wait_for_selector("#isagi-download a")
        with page.expect_download() as dl:
            page.locator("#isagi-download a").first.click()
        saved = tmp_path / "hostile.miku"
        dl.value.save_as(saved)
        open_tab(page, "Chat")
        sid = session_id(page)
        page.click("#isagi-new")
        page.wait_for_function(
            "sid => !document.querySelector('#isagi-manifold-summary').innerText.includes(sid)", arg=sid)
        open_tab(page, "Sessions")
        page.set_input_files("#isagi-upload input[type=file]", str(saved))
        wait_text(page, "#isagi-files-note", "Loaded")
        open_tab(page, "Chat")
        page.wait_for_function("() => document.querySelectorAll('#isagi-chat .isagi-info').length >= 2")
        # 4. the Sessions table lists the title
        rows = table_rows(page)
        assert any(beacon.url in r.get("title", "") for r in rows), rows
        open_tab(page, "Chat")
        page.wait_for_timeout(1500)  # time for any late fetch (lazy images, KaTeX, mermaid)
        page.screenshot(path=str(screenshot_dir / "hostile-texts-rendered.png"), full_page=True)

        chat = page.locator("#isagi-chat")
        assert chat.inner_text().count("a plain link") >= 4  # the texts are shown (2 questions, 2 replies)
        links = page.eval_on_selector_all("#isagi-chat a[href]", "as => as.map(a => a.href)")
        assert beacon.url + "/reply/link" in links and beacon.url + "/user/link" in links, "links stay links"
        imgs = page.eval_on_selector_all("img, image, video, iframe, link[rel=prefetch]",
                                         "es => es.map(e => e.outerHTML)")
        assert not [e for e in imgs if beacon.url in e and "control.png" not in e], imgs
    finally:
        ctx.close()
    assert beacon.hits == ["/control.png"], beacon.hits
    assert [u for u in seen if beacon.url in u] == [beacon.url + "/control.png"], seen
