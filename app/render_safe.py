"""Making text that can come from outside safe to put on the page.

Owns the escaping rules of the web app. Anything a ``.miku`` upload, the
history store or a message can carry (tiers, verdicts, zones, categories,
titles, queries, replies) is hostile until it passes one of these functions:

* :func:`esc` for interpolation into HTML (text and attribute values);
* :func:`enum_label` for values that are enums (tiers, verdicts): an unknown
  one is shown as ``?`` and never reaches a class name;
* :func:`md_cell` for a value inside the app's own markdown (the Turn table);
* :func:`safe_markdown` for a message shown as markdown in the Chatbot: raw
  HTML tags are shown as text and images become plain links, so the browser
  never fetches a URL named in a message (a tracking beacon), while code
  spans and fenced code keep their text exactly (code is never rendered as HTML);
* :func:`hover_text` for plotly hover and legend texts (plotly renders a
  subset of HTML in them, and ``%{...}`` in a template).

Gradio's ``sanitize_html`` (DOMPurify in the browser) removes scripts and
event handlers but keeps ``<img>`` and markdown images, so it does not stop a
beacon; these rules apply before the text reaches Gradio.
"""

from __future__ import annotations

import html
import re
from typing import Any

TIERS = ("RETRIEVE", "AUGMENT", "EXPAND", "EXPLORE")
VERDICTS = ("ok", "refused", "withheld", "cancelled")
UNKNOWN = "?"

# Fenced code blocks (``` or ~~~, to the closing fence or the end) and inline code spans.
_CODE = re.compile(
    r"(?P<fence>^[ \t]{0,3}(?P<mark>`{3,}|~{3,})[^\n]*\n.*?(?:^[ \t]{0,3}(?P=mark)[ \t]*$|\Z))"
    r"|(?P<span>(?P<ticks>`+)(?!`).+?(?<!`)(?P=ticks)(?!`))",
    re.MULTILINE | re.DOTALL,
)


def esc(value: Any) -> str:
    """``value`` as text safe inside HTML text and quoted attribute values.

    The "!" of an image's markdown (``![alt](url)``) becomes an entity too, for
    HTML that a markdown renderer also sees (the Chatbot's info line): the same
    text shows, and no image is made of it.
    """
    return _no_images(html.escape("" if value is None else str(value), quote=True))


def _no_images(text: str) -> str:
    """"![" written as "&#33;[": shown the same, but "![alt](url)" is no longer an image, only a link."""
    return text.replace("![", "&#33;[")


def enum_label(value: Any, allowed: tuple[str, ...] | set[str] | frozenset[str]) -> str:
    """``value`` if it is one of ``allowed`` (compared as given), else ``?``."""
    return value if isinstance(value, str) and value in allowed else UNKNOWN


def _neutralise(text: str) -> str:
    """Markdown outside code: raw HTML shown as text, images turned into links."""
    # "![alt](url)", "![alt][ref]" and "![alt]" are images only with a literal "!":
    # after an entity they show the same text and a link, which the browser does not fetch.
    return _no_images(text.replace("<", "&lt;"))


def safe_markdown(text: Any) -> str:
    """A message as markdown the Chatbot may render: no HTML tags, no images."""
    s = "" if text is None else str(text)
    out: list[str] = []
    pos = 0
    for m in _CODE.finditer(s):
        out.append(_neutralise(s[pos:m.start()]))
        out.append(m.group(0))  # code is shown as text by the markdown renderer
        pos = m.end()
    out.append(_neutralise(s[pos:]))
    return "".join(out)


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
