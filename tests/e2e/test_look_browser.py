"""The page people expect (issue 39), as Chromium shows it on the fake engine: coloured code,
typeset maths with prices left as prose, readable text in light and dark (every text of the
chat tab at 4.5:1 or more against what is behind it, WCAG relative luminance), plots that
follow the theme, one font per bold word, and messages and inputs named by their text.

Each theme's page also leaves screenshots in ``artifacts/screenshots/`` (``look-light-1440.png``,
``look-dark-390.png``, ...), after a short chat whose reply holds a code block and maths.
"""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.e2e.conftest import live_server, open_page
from tests.e2e.test_web_e2e import send_and_wait

pytestmark = pytest.mark.browser

REPLY = ("Here is the function:\n\n```python\ndef area(r: float) -> float:\n    \"\"\"A circle's area.\"\"\"\n"
         "    return 3.14159 * r ** 2  # pi r squared\n```\n\nIts formula is $A = \\pi r^2$, and summed:\n\n"
         "$$\\sum_{k=1}^{n} k = \\frac{n(n+1)}{2}$$\n\nA pizza costs $5 and a drink $10.")
QUESTION = "What is the area of a circle? Show `code`."

# Every element with text of its own, visible, on the open tab: its colour against the colour
# behind it (its own and its ancestors' backgrounds, composited), as WCAG 2 contrast.
CONTRAST_JS = """
() => {
  const rgba = (s) => { const m = s.match(/[\\d.]+/g) || [0, 0, 0, 0];
    return [+m[0], +m[1], +m[2], m.length > 3 ? +m[3] : 1]; };
  const over = (top, under) => { const a = top[3] + under[3] * (1 - top[3]);
    if (!a) return [0, 0, 0, 0];
    return [0, 1, 2].map((i) => (top[i] * top[3] + under[i] * under[3] * (1 - top[3])) / a).concat([a]); };
  const lum = (c) => { const f = (v) => { v /= 255; return v <= 0.03928 ? v / 12.92 : ((v + 0.055) / 1.055) ** 2.4; };
    return 0.2126 * f(c[0]) + 0.7152 * f(c[1]) + 0.0722 * f(c[2]); };
  const behind = (el) => { const layers = [];
    for (let e = el; e; e = e.parentElement) layers.push(rgba(getComputedStyle(e).backgroundColor));
    let c = rgba(getComputedStyle(document.documentElement).backgroundColor);
    if (c[3] === 0) c = [255, 255, 255, 1];
    for (const l of layers.reverse()) c = over(l, c);
    return c; };
  const out = [];
  for (const el of document.querySelectorAll('.gradio-container *')) {
    if (el.closest('svg, .katex-mathml, [hidden], .hoverlayer')) continue;
    const own = Array.from(el.childNodes).some((n) => n.nodeType === 3 && n.textContent.trim());
    if (!own) continue;
    const s = getComputedStyle(el);
    const r = el.getBoundingClientRect();
    if (!r.width || !r.height || s.visibility !== 'visible' || el.closest('[style*="display: none"]')) continue;
    if (!el.checkVisibility({ opacityProperty: true, visibilityProperty: true })) continue;
    let fg = rgba(s.color);
    const bg = behind(el);
    fg = over(fg, bg);
    const [a, b] = [lum(fg), lum(bg)].sort((x, y) => y - x);
    out.push({ text: el.textContent.trim().slice(0, 40), tag: el.tagName, cls: String(el.className).slice(0, 60),
               ratio: (a + 0.05) / (b + 0.05), fg: s.color, bg: 'rgb(' + bg.slice(0, 3).map(Math.round) + ')' });
  }
  return out;
}
"""


@pytest.fixture(scope="module")
def look_url(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    with live_server(tmp_path_factory, fake=True, fake_args=("--reply", REPLY)) as url:
        yield url


@pytest.fixture(scope="module", params=["light", "dark"])
def chatted(request, browser, look_url):
    """A page in ``light`` or ``dark`` after one question, its reply holding code and maths."""
    theme = request.param
    ctx = browser.new_context(viewport={"width": 1440, "height": 1000}, color_scheme=theme)
    try:
        page = open_page(ctx, f"{look_url}?__theme={theme}")
        send_and_wait(page, QUESTION)
        page.wait_for_selector("#isagi-chat .katex")
        page.wait_for_selector("#isagi-map .xtick text")  # the map drawn after the turn (the empty one has no axes)
        page.wait_for_timeout(800)  # the plots' last redraw
        yield theme, page
    finally:
        ctx.close()


def test_the_theme_is_the_one_asked(chatted) -> None:
    theme, page = chatted
    assert page.evaluate("document.body.classList.contains('dark')") == (theme == "dark")


def test_code_is_coloured_and_keeps_its_text(chatted) -> None:
    _, page = chatted
    code = page.locator("#isagi-chat code.isagi-code").last
    assert code.inner_text().startswith("def area(r: float) -> float:\n")
    keyword = page.eval_on_selector("#isagi-chat code.isagi-code .hl-k", "e => getComputedStyle(e).color")
    plain = page.eval_on_selector("#isagi-chat code.isagi-code", "e => getComputedStyle(e).color")
    comment = page.eval_on_selector("#isagi-chat code.isagi-code .hl-c1", "e => getComputedStyle(e).color")
    assert len({keyword, plain, comment}) == 3, (keyword, plain, comment)
    assert page.locator("#isagi-chat .copy_code_button").count() >= 1


def test_maths_is_typeset_and_prices_are_prose(chatted) -> None:
    _, page = chatted
    reply = page.locator("#isagi-chat [data-testid=bot]").first
    assert reply.locator(".katex").count() == 2 and reply.locator(".katex-display").count() == 1
    assert reply.locator(".katex-error").count() == 0
    assert "A pizza costs $5 and a drink $10." in reply.inner_text()
    assert "\\pi" not in reply.locator(".message-content").evaluate(
        "e => { const c = e.cloneNode(true); c.querySelectorAll('.katex-mathml').forEach(n => n.remove());"
        " return c.innerText; }"), "no raw TeX left on the page"


def test_messages_and_inputs_are_named_by_their_text(chatted) -> None:
    _, page = chatted
    labels = page.eval_on_selector_all("#isagi-chat [data-testid=user], #isagi-chat [data-testid=bot]",
                                       "es => es.map(e => e.getAttribute('aria-label'))")
    assert labels and not [x for x in labels if x is None or "<" in x or "&lt;" in x], labels
    assert any(x.startswith("Your message: What is the area of a circle? Show code.") for x in labels), labels
    assert any(x.startswith("Reply: Here is the function: def area(r: float)") for x in labels), labels
    assert page.get_by_role("textbox", name="Message", exact=True).count() == 1
    assert page.get_by_role("button", name="Send", exact=True).count() == 1


def test_a_bold_title_is_drawn_in_one_font(chatted) -> None:
    """Gradio's bundled semibold face lacks most glyphs: its words came out in two fonts."""
    _, page = chatted
    cdp = page.context.new_cdp_session(page)
    cdp.send("DOM.enable")
    cdp.send("CSS.enable")
    root = cdp.send("DOM.getDocument", {"depth": -1})["root"]["nodeId"]
    for selector in ("h2", "#isagi-status strong", ".isagi-tier"):
        node = cdp.send("DOM.querySelector", {"nodeId": root, "selector": selector})["nodeId"]
        fonts = cdp.send("CSS.getPlatformFontsForNode", {"nodeId": node})["fonts"]
        assert len(fonts) == 1 and fonts[0]["isCustomFont"], (selector, fonts)


def test_every_text_has_contrast_and_the_plots_follow_the_theme(chatted) -> None:
    theme, page = chatted
    found = page.evaluate(CONTRAST_JS)
    assert len(found) > 40 and any(f["cls"].startswith("hl-") for f in found)
    low = [f for f in found if f["ratio"] < 4.5]
    assert not low, "\n".join(f"{f['ratio']:.2f} {f['tag']}.{f['cls']} {f['text']!r} {f['fg']} on {f['bg']}"
                               for f in low)
    info = page.eval_on_selector("#isagi-chat .isagi-info", "e => getComputedStyle(e).color")
    page_bg = page.evaluate("getComputedStyle(document.body).backgroundColor")
    ticks = page.eval_on_selector("#isagi-map .xtick text", "e => getComputedStyle(e).fill")
    paper = page.eval_on_selector_all("#isagi-map .main-svg rect.bg",
                                      "es => es.map(e => getComputedStyle(e).fillOpacity)")
    assert paper and set(paper) == {"0"}, paper  # paper and plot are see-through: the page shows
    if theme == "dark":
        bright = [int(v) for v in ticks[ticks.index("(") + 1:ticks.index(")")].split(",")[:3]]
        assert min(bright) > 150, (ticks, page_bg)  # light text on the dark page
        assert info != "rgb(68, 68, 68)", info


@pytest.mark.parametrize("width", [1440, 390])
def test_screenshots(chatted, width, screenshot_dir) -> None:
    theme, page = chatted
    page.set_viewport_size({"width": width, "height": 1000 if width > 500 else 844})
    try:
        page.wait_for_timeout(800)
        assert page.evaluate("document.documentElement.scrollWidth") <= width + 1, "no sideways scrolling"
        page.screenshot(path=str(screenshot_dir / f"look-{theme}-{width}.png"), full_page=width < 500)
    finally:
        page.set_viewport_size({"width": 1440, "height": 1000})
