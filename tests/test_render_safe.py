"""Hostile text from a file, a message or the model through every rendering helper of
the page and every plot: no HTML tag from the input survives, no image is left for
the browser to fetch (chat texts arrive as finished HTML with no ``<img>``, no
markdown image and no mermaid block left), enums (tiers, verdicts) are
allowlisted, code keeps its text."""

from __future__ import annotations

import json
import re
from html.parser import HTMLParser
from types import SimpleNamespace
from typing import Any

import numpy as np
import pytest

from isagi.app import plots
from isagi.app.render_safe import esc, hover_text, md_cell, render_text
from isagi.app.views import (
    badge_label,
    chat_messages,
    info_html,
    manifold_summary,
    pending_html,
    turn_markdown,
    user_html,
)
from isagi.manifold.memory import TrajectoryMemory

HOSTILE = [
    '"><script>alert(1)</script>',
    '" onmouseover="x',
    "<img src=http://x/a.png>",
    "![a](http://x/b.png)",
    "<iframe src=//x></iframe>",
    "![ref][r]\n\n[r]: http://x/c.png",
    "%{x}<b>bold</b>",
    "a | b ` c \\| d",
]
IMAGE_MD = re.compile(r"!\[")


class _Tags(HTMLParser):
    def __init__(self) -> None:
        super().__init__()
        self.tags: list[tuple[str, list[tuple[str, str | None]]]] = []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        self.tags.append((tag, attrs))


def _no_markup(out: str, allowed: set[str] = frozenset()) -> None:
    """As a browser parses it: only the app's own tags (each with a class, or the app's own
    hover help as its title), no image."""
    from isagi.app.help_text import BADGE_HELP, FIGURE_HELP

    app_titles = set(BADGE_HELP.values()) | set(FIGURE_HELP.values())
    parser = _Tags()
    parser.feed(out)
    parser.close()
    for tag, attrs in parser.tags:
        assert tag in allowed, (tag, out)
        names = [name for name, _ in attrs]
        assert names in (["class"], ["title"], ["class", "title"]), (attrs, out)
        assert all(v in app_titles for n, v in attrs if n == "title"), (attrs, out)
    low = out.lower()
    assert "<img" not in low and "<script" not in low and "<iframe" not in low and "<b>" not in low
    assert not IMAGE_MD.search(out), out


def _hostile_message(text: str) -> dict[str, Any]:
    return {"role": "assistant", "text": text, "tier": text, "verdict": text, "zone": text,
            "category": text, "nearest_query": text, "distance": text, "teh_prompt": text,
            "teh_reply": text, "latency_s": text, "new_tokens": text, "prompt_tokens": text,
            "metric_growth": text}


@pytest.mark.parametrize("text", HOSTILE)
def test_info_line_escapes_and_allowlists_every_field(text: str) -> None:
    out = info_html(_hostile_message(text))
    _no_markup(out, {"div", "span"})
    assert re.findall(r'class="([^"]*)"', out) == ["isagi-info", "isagi-tier isagi-tier-unknown"]
    assert badge_label(_hostile_message(text)) == "?"


@pytest.mark.parametrize("text", HOSTILE)
def test_pending_line_allowlists_the_tier(text: str) -> None:
    out = pending_html(text, None)
    _no_markup(out, {"div", "span"})
    assert "isagi-tier-unknown" in out
    assert "isagi-tier-augment" in pending_html("AUGMENT", 0.5) and "isagi-tier-pending" in pending_html(None, None)


@pytest.mark.parametrize("text", HOSTILE)
def test_turn_panel_escapes_every_field_and_keeps_the_table(text: str) -> None:
    out = turn_markdown(_hostile_message(text))
    _no_markup(out)
    assert "<" not in out.replace("<br>", ""), "no tag at all in the app's markdown"
    lines = out.splitlines()
    assert len(lines) == 12 and all(line.count("|") - line.count("\\|") == 3 for line in lines[2:]), out


# Markdown that a second parser (the browser's) could read differently from a source
# rewrite: code spans across paragraphs, escaped backticks, fences with odd info strings,
# reference images, mermaid diagrams whose labels hold HTML, entities, autolinks.
EDGE = [
    "`a\n\n![x](http://h/i.png)\n\n`",
    "\\` <img src=http://h/x> `",
    "```a`b\n![x](http://h/i.png)\n```",
    "```mermaid\ngraph TD; A[\"<img src='http://h/m.png'>\"]\n```",
    "&lt;img src=http://h/e.png&gt; &#33;[x](http://h/f.png)",
    "![x][r]\n\n[r]: http://h/r.png",
    "<http://h/auto> <img/src=http://h/s> <svg><image href=http://h/v /></svg>",
    "[![inner](http://h/n.png)](http://h/outer)",
    "<details open ontoggle=x><summary>s</summary></details> <style>*{background:url(http://h/c)}</style>",
]


def _rendered_tags(out: str) -> list[tuple[str, list[tuple[str, str | None]]]]:
    parser = _Tags()
    parser.feed(out)
    parser.close()
    return parser.tags


RENDERED = {"p", "a", "code", "pre", "div", "button", "span", "svg", "path", "br", "em", "strong",
            "table", "thead", "tbody", "tr", "th", "td", "s", "ul", "ol", "li", "blockquote", "h1", "h2",
            "h3", "h4", "h5", "h6", "hr"}


@pytest.mark.parametrize("text", HOSTILE + EDGE)
def test_render_text_leaves_no_image_and_no_tag_of_the_text(text: str) -> None:
    out = render_text(text)
    for tag, attrs in _rendered_tags(out):
        assert tag in RENDERED, (tag, out)  # only what the parser itself writes
        for name, value in attrs:
            assert not name.startswith("on") and name not in ("src", "srcset", "style", "background"), out
            if name == "href":
                assert value and not value.lower().startswith(("javascript:", "data:", "vbscript:")), out
    low = out.lower()
    for bad in ("<img", "<script", "<iframe", "<svg><image", "<style", "<details", 'class="mermaid"'):
        assert bad not in low, (bad, out)
    assert not IMAGE_MD.search(out), "no markdown image is left for a second renderer either"


@pytest.mark.parametrize("text", HOSTILE)
def test_chat_messages_show_html_as_text_and_images_as_links(text: str) -> None:
    msgs = chat_messages([{"role": "user", "text": text}, _hostile_message(text)], first_turn=3)
    assert [m["role"] for m in msgs] == ["user", "assistant", "assistant"]
    assert msgs[0]["content"] == user_html(text, 3) and msgs[1]["content"] == render_text(text)
    _no_markup(msgs[2]["content"], {"div", "span"})
    # the user message's frame: the turn's class, the exact text as a text node, then the rendered text
    assert _frame(msgs[0]["content"]) == (["isagi-user", "isagi-turn-3"], text)
    assert msgs[0]["content"].endswith(render_text(text) + "</div>")


def _frame(html_text: str) -> tuple[list[str], str]:
    """The classes of a user message's frame, and the text of its hidden raw copy, as a browser parses them."""
    from html.parser import HTMLParser

    found: dict[str, Any] = {"classes": [], "raw": None}

    class P(HTMLParser):
        def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
            cls = dict(attrs).get("class") or ""
            if tag == "div" and not found["classes"]:
                found["classes"] = cls.split()
            if cls == "isagi-raw":
                found["raw"] = ""

        def handle_endtag(self, tag: str) -> None:
            if tag == "span" and found["raw"] is not None and "done" not in found:
                found["done"] = True

        def handle_data(self, data: str) -> None:
            if found["raw"] is not None and "done" not in found:
                found["raw"] += data

    P(convert_charrefs=True).feed(html_text)
    return found["classes"], found["raw"]


def test_images_become_links_with_their_text_kept() -> None:
    link = '<a href="http://x/b.png" target="_blank" rel="noopener noreferrer nofollow">a cat</a>'
    assert render_text("see ![a cat](http://x/b.png) now") == f"<p>see !{link} now</p>\n"
    assert "<a href=\"http://x/c.png\"" in render_text("![x][r]\n\n[r]: http://x/c.png")
    assert render_text("Wow! [link](http://x)").startswith('<p>Wow! <a href="http://x"')
    assert render_text('<img src="http://x/a.png">') == "<p>&lt;img src=&quot;http://x/a.png&quot;&gt;</p>\n"
    assert render_text("2 < 3 and **bold**") == "<p>2 &lt; 3 and <strong>bold</strong></p>\n"
    assert render_text("[x](javascript:alert(1))") == "<p>[x](javascript:alert(1))</p>\n", "no script link"
    assert render_text("") == render_text(None) == render_text("  \n ") == ""


def _code_text(out: str) -> list[str]:
    """The text of each code block of ``out`` as the browser shows it (token spans taken off)."""
    import html as html_

    blocks = re.findall(r'<pre><code class="isagi-code[^"]*">(.*?)</code></pre>', out, re.S)
    return [html_.unescape(re.sub(r'</?span(?: class="hl-[A-Za-z0-9]+")?>', "", b)) for b in blocks]


class _CodeTags(HTMLParser):
    """Every tag inside a ``<code>`` element, with its attributes."""

    def __init__(self) -> None:
        super().__init__()
        self.depth, self.inside = 0, []

    def handle_starttag(self, tag: str, attrs: list[tuple[str, str | None]]) -> None:
        if self.depth:
            self.inside.append((tag, attrs))
        self.depth += tag == "code"

    def handle_endtag(self, tag: str) -> None:
        self.depth -= tag == "code" and self.depth > 0


def _only_token_spans(out: str) -> None:
    """Inside code: nothing but ``<span class="hl-…">`` (no other tag, no other attribute)."""
    parser = _CodeTags()
    parser.feed(out)
    parser.close()
    for tag, attrs in parser.inside:
        assert tag == "span" and len(attrs) == 1 and attrs[0][0] == "class", (tag, attrs)
        assert re.fullmatch(r"hl-[A-Za-z0-9]+", attrs[0][1] or ""), attrs


def test_code_keeps_its_text_exactly() -> None:
    fenced = "Use this:\n```html\n<img src=a.png> ![x](y)\n```\nand <b>not</b> this"
    out = render_text(fenced)
    assert _code_text(out) == ["<img src=a.png> ![x](y)\n"], "code is shown as written"
    assert 'class="copy_code_button"' in out, "a code block keeps a copy button"
    assert out.endswith("<p>and &lt;b&gt;not&lt;/b&gt; this</p>\n")
    assert "<code>a&lt;b&gt;()</code>" in render_text("call `a<b>()` then <i>x</i>")
    unclosed = render_text("```\n<script>x</script>")  # an unclosed fence runs to the end: still code
    assert '<pre><code class="isagi-code">&lt;script&gt;x&lt;/script&gt;</code></pre>' in unclosed
    assert "language-" not in render_text('```x" onclick="y\ncode\n```'), "no attribute from the info"


CODE = 'def f(x):\n    """<img src=x onerror=y>"""\n    return "</code></pre><script>1</script>"  # $x$ ![a](b)\n\n\n'


@pytest.mark.parametrize("lang", ["python", "Python", "py", "html", "js", "bash", "json", "latex", "markdown",
                                  "sql", "c++", "xml", "diff", "mermaid", "nosuchlanguage"])
def test_coloured_code_has_only_class_spans_and_its_exact_text(lang: str) -> None:
    out = render_text(f"```{lang}\n{CODE}```\nafter")
    _only_token_spans(out)
    assert _code_text(out) == [CODE], "blank lines, quotes and markup inside code are kept as written"
    assert "<script" not in out.lower() and "<img" not in out.lower() and "isagi-math" not in out
    assert out.count('class="copy_code_button"') == 1 and out.endswith("<p>after</p>\n")


def test_code_is_coloured_only_for_a_named_known_language() -> None:
    python = render_text("```python\ndef f(): return 1\n```")
    assert '<span class="hl-k">def</span>' in python and 'class="isagi-code language-python"' in python
    for plain in ("```\ndef f(): return 1\n```", "    def f(): return 1",  # no language named: none guessed
                  "```nosuchlanguage\ndef f(): return 1\n```"):
        out = render_text(plain)
        assert "<span" not in out.split("</button>", 1)[1] and _code_text(out) == ["def f(): return 1\n"], plain


@pytest.mark.parametrize("info", ['python" onload="alert(1)', "python' onmouseover='x", "python><img src=x>",
                                  'py"><script>alert(1)</script>', "javascript:alert(1)", "a" * 200])
def test_a_hostile_fence_info_string_reaches_no_attribute(info: str) -> None:
    out = render_text(f"```{info}\nprint(1)\n```")
    _only_token_spans(out)
    parser = _Tags()
    parser.feed(out)
    for tag, attrs in parser.tags:
        assert all(not name.startswith("on") for name, _ in attrs), (tag, attrs)
        if tag == "code":
            assert attrs == [("class", "isagi-code")], attrs  # the hostile info names no language
    assert "<img" not in out and "<script" not in out and _code_text(out) == ["print(1)\n"]


def test_huge_code_is_shown_plain_and_whole() -> None:
    from isagi.app.render_safe import HIGHLIGHT_MAX_CHARS

    huge = "x = '<b>' + 1\n" * (HIGHLIGHT_MAX_CHARS // 10)
    out = render_text(f"```python\n{huge}```")
    assert _code_text(out) == [huge] and "<span" not in out.split("</button>", 1)[1]
    small = render_text("```python\nx = 1\n```")
    assert "hl-" in small


def test_dollar_maths_is_marked_for_katex_and_prices_stay_prose() -> None:
    from isagi.app.render_safe import LATEX_DELIMITERS

    assert render_text("It costs $5 and $10.") == "<p>It costs $5 and $10.</p>\n"
    assert render_text("between $5 and $10, or $ 3 $") == "<p>between $5 and $10, or $ 3 $</p>\n"
    assert render_text("Euler: $e^{i\\pi} + 1 = 0$ here") == (
        '<p>Euler: <span class="isagi-math">\\(e^{i\\pi} + 1 = 0\\)</span> here</p>\n')
    assert render_text("so $$\\int_0^1 x\\,dx$$ inline") == (
        '<p>so <span class="isagi-math">\\[\\int_0^1 x\\,dx\\]</span> inline</p>\n')
    assert render_text("$$\na < b\n$$") == '<div class="isagi-math">\\[a &lt; b\\]</div>\n'
    # maths is not read in code, and markdown is not read in maths
    assert "isagi-math" not in render_text("`$x$` and\n```\n$y$\n```")
    assert render_text("$a*b*c$") == '<p><span class="isagi-math">\\(a*b*c\\)</span></p>\n'
    hostile = render_text('$<img src=x onerror="y">$ and $$</span><script>1</script>$$')
    parser = _Tags()
    parser.feed(hostile)
    assert parser.tags == [("p", []), ("span", [("class", "isagi-math")]), ("span", [("class", "isagi-math")])]
    # the page's KaTeX reads only the delimiters written here: a $ of the text is never maths
    assert {d["left"] for d in LATEX_DELIMITERS} == {"\\(", "\\["} and "$" not in str(LATEX_DELIMITERS)


def test_code_colours_are_scoped_to_code_in_each_theme_and_fetch_nothing() -> None:
    from isagi.app.layout import page_css
    from isagi.app.render_safe import code_css

    css = code_css()
    rules = [line for line in css.splitlines() if line.strip()]
    assert len(rules) > 50
    light = [r for r in rules if r.startswith("body:not(.dark) .isagi-code .hl-")]
    dark = [r for r in rules if r.startswith(".dark .isagi-code .hl-")]
    assert len(light) + len(dark) == len(rules) and light and dark, "every rule is a token of one theme"
    assert "url(" not in css and "@import" not in css
    assert css in page_css() and "SourceSansPro-Bold.woff2" in page_css()


def test_summary_shows_a_bad_session_id_escaped() -> None:
    session = SimpleNamespace(memory=TrajectoryMemory(4), metric=SimpleNamespace(growth=0.0), turns=[],
                              id='`<img src=x onerror="y">`')
    out = manifold_summary(session)
    _no_markup(out)
    good = SimpleNamespace(memory=TrajectoryMemory(4), metric=SimpleNamespace(growth=0.0), turns=[], id="0123456789ab")
    assert "`0123456789ab`" in manifold_summary(good)


@pytest.mark.parametrize("text", HOSTILE)
def test_the_small_rules(text: str) -> None:
    for out in (esc(text), md_cell(text), hover_text(text)):
        assert "<" not in out and '"' not in out
    assert "%{" not in hover_text(text) and "\n" not in md_cell(text)
    assert not IMAGE_MD.search(md_cell(text))


def _figure_strings(fig: Any) -> list[str]:
    """Every text plotly may render as (pseudo-)HTML: hover texts, templates, trace names."""
    data = json.loads(fig.to_json())["data"]
    out: list[str] = []
    for trace in data:
        for key in ("text", "hovertext", "hovertemplate", "name"):
            v = trace.get(key)
            if isinstance(v, str):
                out.append(v)
            elif isinstance(v, list):
                out += [str(x) for x in v]
    return out


@pytest.mark.parametrize("text", HOSTILE)
def test_plot_hover_texts_and_legends_are_escaped(text: str) -> None:
    n = 3
    columns = {"query_x": np.random.default_rng(0).standard_normal((n, 4)), "query_text": [text] * n,
               "tier": [text, "EXPLORE", text], "cluster": [0, 1, 1]}
    messages = [{"role": "user", "text": text}, _hostile_message(text) | {"metric_growth": 0.1}]
    figs = [plots.map_figure(columns, highlight=1), plots.map_figure(columns, colour_by="cluster"),
            plots.growth_figure(messages), plots.teh_figure(messages)]
    for fig in figs:
        for s in _figure_strings(fig):
            # the templates' own <extra> tags are plotly's; nothing else may open a tag
            assert "<" not in re.sub(r"</?extra>", "", s), s
            assert not IMAGE_MD.search(s)
    names = {t["name"] for t in json.loads(figs[0].to_json())["data"]}
    assert names <= {"New topic", "?", "current query"}, "unknown tiers are grouped as ?; tiers by their plain name"
