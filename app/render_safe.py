"""Making text that can come from outside safe to put on the page.

Owns the escaping and rendering rules of the web app. Anything a ``.miku``
upload, the history store, a message or the model can carry (replies, stored
replies, streamed partial replies, queries, titles, tiers, verdicts, zones,
categories, file names, error messages) is hostile until it passes one of
these functions:

* :func:`render_text` for every message text the chat shows (the user's, the
  model's while it streams and once finished, stored replies, loaded files):
  markdown rendered to HTML *on the server* by one CommonMark parser
  (markdown-it-py) with raw HTML off and images off, so the page inserts
  finished HTML and no markdown, HTML, mermaid or image syntax in the text can
  make the browser fetch anything; links stay links (fetched only when
  clicked), code keeps its text exactly (coloured by Pygments into class-only
  spans when its fence names a language Pygments knows, plain text otherwise),
  and ``$…$`` / ``$$…$$`` maths is marked for the page's KaTeX (:data:`LATEX_DELIMITERS`);
* :func:`esc` for interpolation into HTML (text and attribute values) and for
  a line of outside text in the app's own markdown (notes, alerts, toasts);
* :func:`enum_label` for values that are enums (tiers, verdicts): an unknown
  one is shown as ``?`` and never reaches a class name;
* :func:`md_cell` for a value inside the app's own markdown tables and notes;
* :func:`hover_text` for plotly hover and legend texts (plotly renders a
  subset of HTML in them, and ``%{...}`` in a template).

Why on the server: Gradio's sanitiser (DOMPurify in the browser) removes
scripts but keeps ``<img>`` and markdown images, and its markdown renderer also
draws mermaid diagrams (whose labels may hold images); rewriting markdown
source so that a second parser in the browser reads it safely depends on both
parsers agreeing on every edge case of code spans and fences, which they do
not. One parser producing the final HTML has no second reading.

Maths: the server decides what is maths (markdown-it's dollarmath rule: no space
inside the dollars, no digit after the closing one, so ``$5 and $10`` stays
prose) and writes it, escaped, between ``\\(…\\)`` or ``\\[…\\]``; the Chatbot's
KaTeX (bundled with Gradio's page, run even with ``render_markdown=False``) typesets
only those delimiters, skipping code, with KaTeX's ``trust`` off (no ``\\href``,
no ``\\includegraphics``). Code colours: :func:`code_css` for the page's light and
dark themes.
"""

from __future__ import annotations

import functools
import html
import re
from typing import Any

TIERS = ("RETRIEVE", "AUGMENT", "EXPAND", "EXPLORE")
VERDICTS = ("ok", "refused", "withheld", "cancelled")
UNKNOWN = "?"


def esc(value: Any) -> str:
    """``value`` as text safe inside HTML text and quoted attribute values.

    The "!" of an image's markdown (``![alt](url)``) becomes an entity too, for
    text that a markdown renderer also sees (an alert or a note of the app's own
    markdown): the same text shows, and no image is made of it.
    """
    return _no_images(html.escape("" if value is None else str(value), quote=True))


def _no_images(text: str) -> str:
    """"![" written as "&#33;[": shown the same, but "![alt](url)" is no longer an image, only a link."""
    return text.replace("![", "&#33;[")


def enum_label(value: Any, allowed: tuple[str, ...] | set[str] | frozenset[str]) -> str:
    """``value`` if it is one of ``allowed`` (compared as given), else ``?``."""
    return value if isinstance(value, str) and value in allowed else UNKNOWN


# Gradio's own copy button for code blocks (its page copies the block's text when clicked).
_COPY_BUTTON = (
    '<button title="copy" class="copy_code_button"><span class="copy-text">'
    '<svg xmlns="http://www.w3.org/2000/svg" viewBox="0 0 15 15" color="currentColor" aria-hidden="true" '
    'width="15" height="15"><path fill="currentColor" d="M12.728 4.545v8.182H4.545V4.545zm0 -0.909H4.545a0.909 '
    '0.909 0 0 0 -0.909 0.909v8.182a0.909 0.909 0 0 0 0.909 0.909h8.182a0.909 0.909 0 0 0 0.909 -0.909V4.545a0.909 '
    '0.909 0 0 0 -0.909 -0.909"/><path fill="currentColor" d="M1.818 8.182H0.909V1.818a0.909 0.909 0 0 1 0.909 '
    '-0.909h6.364v0.909H1.818Z"/></svg></span><span class="check"><svg xmlns="http://www.w3.org/2000/svg" '
    'width="17" height="17" viewBox="0 0 17 17" aria-hidden="true" fill="none" stroke="currentColor" '
    'stroke-width="1.3"><path d="m13.813 4.781 -7.438 7.438 -3.188 -3.188"/></svg></span></button>'
)
_LANGUAGE = re.compile(r"[A-Za-z0-9_+#.-]{1,32}")
HIGHLIGHT_MAX_CHARS = 20_000  # a longer block is shown plain: colouring it on every streamed token costs too much
CODE_CLASS = "isagi-code"
TOKEN_PREFIX = "hl-"  # Pygments' short token classes ("k", "s") prefixed: no clash with the page's own classes
LIGHT_STYLE, DARK_STYLE = "xcode", "github-dark"  # every token colour at 4.5:1 on the code background
# The Chatbot's latex_delimiters: only the ones render_text writes around the maths it found.
LATEX_DELIMITERS: list[dict[str, str | bool]] = [{"left": "\\(", "right": "\\)", "display": False},
                                                 {"left": "\\[", "right": "\\]", "display": True}]


@functools.cache
def _formatter() -> Any:
    from pygments.formatters import HtmlFormatter

    return HtmlFormatter(nowrap=True, classprefix=TOKEN_PREFIX)


def _highlighted(code: str, lang: str) -> str:
    """``code`` as escaped HTML, its tokens in ``<span class="hl-…">`` when Pygments knows
    ``lang`` (by name or alias; never guessed from the text), else plain escaped text."""
    plain = html.escape(code, quote=False)
    if not lang or len(code) > HIGHLIGHT_MAX_CHARS:
        return plain
    from pygments import highlight
    from pygments.lexers import get_lexer_by_name
    from pygments.util import ClassNotFound

    try:
        lexer = get_lexer_by_name(lang.lower(), stripnl=False, ensurenl=False)
    except ClassNotFound:
        return plain
    return highlight(code, lexer, _formatter())


def code_css() -> str:
    """The code colours for the page's CSS: Pygments' :data:`LIGHT_STYLE` on the light page,
    :data:`DARK_STYLE` under Gradio's ``.dark`` class, on the page's own code background."""
    from pygments.formatters import HtmlFormatter

    light = HtmlFormatter(style=LIGHT_STYLE, classprefix=TOKEN_PREFIX)
    dark = HtmlFormatter(style=DARK_STYLE, classprefix=TOKEN_PREFIX)
    return "\n".join([*light.get_token_style_defs(f"body:not(.dark) .{CODE_CLASS}"),
                      *dark.get_token_style_defs(f".dark .{CODE_CLASS}")])


def _code_block(renderer: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
    """A fenced or indented code block: its text escaped, in Gradio's code frame with a copy button."""
    token = tokens[idx]
    info = (token.info or "").split()
    lang = info[0] if info and _LANGUAGE.fullmatch(info[0]) else ""
    cls = f"{CODE_CLASS} language-{lang}" if lang else CODE_CLASS
    return (f'<div class="code_wrap">{_COPY_BUTTON}<pre><code class="{cls}">{_highlighted(token.content, lang)}'
            "</code></pre></div>\n")


def _math(display: bool, block: bool = False) -> Any:
    """A render rule for one kind of dollarmath token: its TeX escaped between the delimiters
    the page's KaTeX reads (inline ``\\(…\\)``, display ``\\[…\\]``)."""
    left, right = ("\\[", "\\]") if display else ("\\(", "\\)")
    tag = "div" if block else "span"

    def rule(renderer: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
        tex = html.escape(tokens[idx].content.strip(), quote=False)
        return f'<{tag} class="isagi-math">{left}{tex}{right}</{tag}>' + ("\n" if block else "")

    return rule


def _link_open(renderer: Any, tokens: Any, idx: int, options: Any, env: Any) -> str:
    """A link opens in a new tab and tells the target nothing (no referrer, no opener)."""
    token = tokens[idx]
    token.attrSet("target", "_blank")
    token.attrSet("rel", "noopener noreferrer nofollow")
    return renderer.renderToken(tokens, idx, options, env)


@functools.cache
def _parser() -> Any:
    """The one markdown parser of the page (built on first use): CommonMark with tables and
    strikethrough, raw HTML shown as text, no image rule (``![a](u)`` is "!" and a link),
    single newlines kept as line breaks (as the Chatbot showed them), ``$…$`` and ``$$…$$`` maths."""
    from markdown_it import MarkdownIt
    from mdit_py_plugins.dollarmath import dollarmath_plugin

    md = MarkdownIt("commonmark", {"html": False, "linkify": False, "typographer": False, "breaks": True})
    md.enable(["table", "strikethrough"]).disable("image")
    dollarmath_plugin(md, allow_labels=False, allow_space=False, allow_digits=False, double_inline=True)
    md.add_render_rule("math_inline", _math(False))
    md.add_render_rule("math_inline_double", _math(True))
    md.add_render_rule("math_block", _math(True, block=True))
    md.add_render_rule("fence", _code_block)
    md.add_render_rule("code_block", _code_block)
    md.add_render_rule("link_open", _link_open)
    return md


def render_text(text: Any) -> str:
    """A message text as the HTML the chat shows: the one rendering of every text, from the
    user, the model (streaming or finished), the history store or an uploaded file.

    No HTML tag of the text survives (it is shown as text), no image is made
    (image syntax becomes "!" and a link), code is shown exactly as written.
    """
    s = "" if text is None else str(text)
    return _parser().render(s, {}) if s.strip() else ""


def md_cell(value: Any) -> str:
    """A value inside the app's own markdown table: one line, no HTML, no images, no cell breaks."""
    s = " ".join(("" if value is None else str(value)).split())
    s = html.escape(s.replace("\\", "\\\\"), quote=True).replace("|", "\\|")
    for ch in "`*_[]":  # no formatting, links or code spans from outside text
        s = s.replace(ch, "\\" + ch)
    return s


def hover_text(value: Any) -> str:
    """Text for a plotly hover label, trace name or legend: entities for its HTML, no template fields."""
    return esc(value).replace("%", "&#37;")
