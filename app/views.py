"""What the page shows, as pure functions of a session or of a turn's figures: the chat's
messages, the turn panel, the badges, the manifold summary and the alert line.

No Gradio and no state: the handlers (:mod:`app.handlers`) call them, and tests call them directly.
Every text from outside is rendered by :func:`app.render_safe.render_text`.
"""

from __future__ import annotations

import html
from typing import TYPE_CHECKING, Any

from isagi.app.help_text import BADGE_HELP, FIGURE_HELP, plain_name
from isagi.app.render_safe import TIERS, UNKNOWN, VERDICTS, enum_label, esc, md_cell, render_text
from isagi.ids import is_session_id
from isagi.session.turn import turns_to_messages

if TYPE_CHECKING:
    from isagi.safety.runtime import SafetyProfile
    from isagi.session.state import Session

# What one page update renders and sends, whatever the session's length: the chat's
# newest turns, and the plots' newest turns and stored trajectories.
CHAT_WINDOW_TURNS = 100


EMPTY_REPLY = "<p><em>(empty reply)</em></p>"


def fmt(v: Any, digits: int = 3, suffix: str = "") -> str:
    """A number for the page; anything else (a file can hold anything) is shown as ``?``."""
    if v is None:
        return "–"
    if isinstance(v, bool):
        return UNKNOWN
    try:
        return f"{float(v):.{digits}f}{suffix}"
    except (TypeError, ValueError, OverflowError):
        return UNKNOWN


def _count(v: Any) -> str:
    """A token count for the page: a whole number, or "–"."""
    if isinstance(v, bool):
        return "–"
    if isinstance(v, int):
        return str(v)
    try:
        f = float(v)
    except (TypeError, ValueError):
        return "–"
    return str(int(f)) if f.is_integer() else "–"


def short(text: str | None, n: int = 70) -> str:
    t = " ".join(str(text or "").split())
    return t if len(t) <= n else t[: n - 1] + "…"


BADGES = (*TIERS, "REFUSED", "WITHHELD", "CANCELLED", "OK", "PENDING")


def badge_label(m: dict[str, Any]) -> str:
    """The badge of an assistant entry: its tier, or its verdict when not ok; ``?`` if unknown.

    Only known labels come out (tiers and verdicts are enums), so the label is
    safe in a class name and in text.
    """
    verdict = m.get("verdict") or "ok"
    if verdict in ("refused", "withheld"):
        return verdict.upper()
    label = m.get("tier") or verdict
    return enum_label(label.upper() if isinstance(label, str) else label, BADGES)


def badge_title(label: str) -> str:
    """A badge's hover text: what it means in plain words, then its technical name."""
    if label not in BADGE_HELP:
        return ""
    kind = "tier" if label in TIERS else "verdict"
    return f"{BADGE_HELP[label]} (Technical name: {kind} {label}.)"


def _badge(label: str) -> str:
    """The badge of technical ``label``: its plain name (:func:`app.help_text.plain_name`) on the
    page, the technical name in its hover title; the class keeps the technical name."""
    cls = label.lower() if label in BADGES else "unknown"
    title = badge_title(label)
    tip = f' title="{esc(title)}"' if title else ""
    return f'<span class="isagi-tier isagi-tier-{cls}"{tip}>{esc(plain_name(label))}</span>'


def _tip(key: str, html_text: str) -> str:
    """``html_text`` (already escaped) with its plain-language explanation on hover."""
    return f'<span title="{esc(FIGURE_HELP[key])}">{html_text}</span>'


def info_html(m: dict[str, Any], *, before: str = "", after: str = "") -> str:
    """The line beside a reply: badge, distance and nearest query, zone, TEH, latency, tokens;
    ``before`` and ``after`` are the app's own HTML around them (continued, a reply's versions).

    Every field can come from an uploaded file: each is escaped (or allowlisted) here.
    """
    parts = [_badge(badge_label(m))]
    if m.get("verdict") == "cancelled":
        parts.append(_badge("CANCELLED"))
    if m.get("distance") is not None:
        near = m.get("nearest_query")
        near_txt = f" to “{esc(short(near, 60))}”" if near else ""
        parts.append(_tip("d", f"d = {fmt(m['distance'], 4)}{near_txt}"))
    if m.get("zone"):
        parts.append(_tip("zone", f"zone {esc(short(m['zone'], 40))}"))
    parts.append(_tip("teh", f"TEH {fmt(m.get('teh_prompt'), 1, '%')} / {fmt(m.get('teh_reply'), 1, '%')}"))
    if m.get("latency_s") is not None:
        parts.append(_tip("latency", f"{fmt(m['latency_s'], 2)} s"))
    toks = m.get("new_tokens")
    if toks is not None:
        pt = m.get("prompt_tokens")
        parts.append(_tip("tokens", f"{_count(pt)} + {_count(toks)} tokens" if pt is not None else f"{_count(toks)} tokens"))
    head, rest = parts[0], " · ".join(parts[1:])
    return f'<div class="isagi-info">{before}{head} {rest}{after}</div>'


def pending_html(tier: str | None, distance: float | None) -> str:
    label = "PENDING" if tier is None else enum_label(tier.upper() if isinstance(tier, str) else tier, BADGES)
    d = f" d = {fmt(distance, 4)} ·" if distance is not None else ""
    return f'<div class="isagi-info isagi-generating">{_badge(label)}{d} generating…</div>'


def user_html(text: Any, turn: int | None = None) -> str:
    """A user message as the chat shows it: its text rendered (:func:`~app.render_safe.render_text`),
    inside a frame that carries, for the page's Edit and Copy, the turn's position (a class,
    ``isagi-turn-N``) and the exact text as sent (escaped text in a span the page's CSS hides).
    Classes and text, because the Chatbot's sanitiser drops ``data-`` attributes."""
    raw = "" if text is None else str(text)
    at = f" isagi-turn-{int(turn)}" if turn is not None else ""
    return (f'<div class="isagi-user{at}"><span class="isagi-raw">{html.escape(raw, quote=False)}</span>'
            f"{render_text(raw)}</div>")


def versions_html(current: int, count: int, *, last: bool) -> str:
    """A reply's versions as the chat shows them: "‹ 2/3 ›" under the last reply (the arrows switch:
    the page's script clicks the hidden events), "version 2 of 3" under an earlier one (a later
    turn was answered from the version shown, so it stays)."""
    if not last:
        return f'<span class="isagi-versions">version {current + 1} of {count}</span>'
    prev = ('<button type="button" class="isagi-version-prev" aria-label="Previous version">‹</button>'
            if current > 0 else "")
    nxt = ('<button type="button" class="isagi-version-next" aria-label="Next version">›</button>'
           if current < count - 1 else "")
    return f'<span class="isagi-versions">{prev}<span>{current + 1}/{count}</span>{nxt}</span>'


def chat_messages(messages: list[dict[str, Any]], first_turn: int | None = None,
                  versions: dict[int, tuple[int, int]] | None = None,
                  last_turn: int | None = None) -> list[dict[str, str]]:
    """Session log → Chatbot messages (each reply followed by its info line).

    Message texts are rendered by :func:`app.render_safe.render_text` (HTML made
    on the server: raw HTML shows as text and images as links, so nothing in a
    message makes the browser fetch a URL); the info line is the app's own
    escaped HTML. ``first_turn``: the position of the first message's turn in its session
    (the user messages then carry theirs, for Edit: :func:`user_html`); ``versions``: (current,
    count) of the turns with several replies, by position, shown in their info lines
    (:func:`versions_html`; the arrows only under ``last_turn``). A continuation (Continue:
    a reply's ``continues``) is shown as part of the reply before it, without its request, with
    the continuation's info line saying so (:data:`CONTINUED`).
    """
    out: list[dict[str, str]] = []
    turn = first_turn
    reply: str | None = None  # the text of the reply shown last, while a continuation may join it
    for i, m in enumerate(messages):
        if m.get("role") == "user":
            after = messages[i + 1] if i + 1 < len(messages) else {}
            if not (reply is not None and after.get("role") == "assistant" and after.get("continues") is True):
                out.append({"role": "user", "content": user_html(m.get("text", ""), turn)})
                reply = None
        elif m.get("role") == "assistant":
            text = m.get("text", "")
            text = text if isinstance(text, str) else ""
            joins = reply is not None and m.get("continues") is True
            shown_versions = versions.get(turn) if versions and turn is not None else None
            tail = " " + versions_html(*shown_versions, last=turn == last_turn) if shown_versions else ""
            info = info_html(m, before=CONTINUED + " · " if joins else "", after=tail)
            reply = (reply or "") + text if joins else text
            shown = [{"role": "assistant", "content": render_text(reply) or EMPTY_REPLY},
                     {"role": "assistant", "content": info}]
            if joins:
                out[-2:] = shown
            else:
                out += shown
            turn = None if turn is None else turn + 1
    return out


# The mark at the start of the info line of a reply extended by Continue (the continuation's own figures follow).
CONTINUED = '<span class="isagi-continued" title="Continue extended this reply past its token limit.">continued</span>'


def chat_window(session: Any, *, drop_last: bool = False, upto: int | None = None) -> list[dict[str, str]]:
    """The Chatbot messages of ``session``'s newest :data:`CHAT_WINDOW_TURNS` turns
    (without its last turn with ``drop_last``: the one a Regenerate replaces; only the first
    ``upto`` turns with ``upto``: those an edited message keeps).

    A turn's page update renders and sends this much and no more, however long the
    session: earlier turns stay in the session, its memory, its exports and the
    history store, and a first line says how many are not shown.
    """
    turns = session.turns[:-1] if drop_last else session.turns
    if upto is not None:
        turns = turns[:upto]
    first = max(0, len(turns) - CHAT_WINDOW_TURNS)
    versions = {i: (v.current, len(v.replies)) for i, v in session.versions.items()
                if i < len(turns)}
    shown = chat_messages(turns_to_messages(turns[first:]), first_turn=first, versions=versions,
                          last_turn=len(session.turns) - 1 if upto is None and not drop_last else None)
    hidden = len(turns) - CHAT_WINDOW_TURNS
    if hidden <= 0:
        return shown
    note = (f"*{hidden:,} earlier exchange{'s' if hidden != 1 else ''} of this session "
            "are not shown here; Export (Sessions tab) has them all.*")
    return [{"role": "assistant", "content": render_text(note)}, *shown]


def distance_cell(d: Any, bounds: tuple[float, float] | None = None) -> str:
    """The Turn panel's distance: d, and with ``bounds`` (this model's calibrated d where
    Related ends and where New topic starts) the tier each range of d gives."""
    shown = fmt(d, 4)
    if bounds is None or d is None:
        return shown
    related, topic = bounds
    return (f"{shown} (0 = the same, 2 = opposite; on this model {plain_name('AUGMENT')} below "
            f"{related:.3f}, {plain_name('EXPAND')} below {topic:.3f}, {plain_name('EXPLORE')} above)")


def turn_markdown(m: dict[str, Any] | None, safety: SafetyProfile | None = None,
                  bounds: tuple[float, float] | None = None) -> str:
    """The Turn panel: every figure of the latest turn (file fields escaped for markdown);
    ``bounds``: the model's tier boundaries of d (:func:`distance_cell`)."""
    if m is None:
        return "*No turn yet. Ask something: the panel shows what the manifold did with it.*"
    thr = safety.threshold if safety is not None else None
    rthr = safety.reply_threshold if safety is not None else None
    category = m.get("category")
    verdict = m.get("verdict") or "ok"
    rows = [
        ("Tier", f"**{plain_name(badge_label(m))}** ({badge_label(m)})"
                 + (f" · {md_cell(short(category, 60))}" if category else "")),
        ("Verdict", verdict if verdict in VERDICTS else UNKNOWN),
        ("Distance d", distance_cell(m.get("distance"), bounds)),
        ("Nearest stored query", md_cell(short(m.get("nearest_query"), 90)) or "–"),
        ("Zone", md_cell(short(m.get("zone"), 40)) or "–"),
        ("TEH prompt", fmt(m.get("teh_prompt"), 2, "%") + (f" (threshold {thr:.2f}%)" if thr is not None else "")),
        ("TEH reply", fmt(m.get("teh_reply"), 2, "%") + (f" (threshold {rthr:.2f}%)" if rthr is not None else "")),
        ("Latency", fmt(m.get("latency_s"), 3, " s")),
        ("Tokens", f"prompt {_count(m.get('prompt_tokens'))}, reply {_count(m.get('new_tokens'))}"),
        ("Metric growth ‖M − I‖", fmt(m.get("metric_growth"), 4)),
    ]
    body = "\n".join(f"| {k} | {v} |" for k, v in rows)
    return "| Latest turn | |\n|---|---|\n" + body


def reply_fields(turn: Any) -> dict[str, Any] | None:
    """A turn's reply with its figures (the assistant message of :meth:`~isagi.session.turn.Turn.to_messages`)."""
    return None if turn is None else turn.to_messages()[1]


def manifold_summary(session: Session) -> str:
    mem = session.memory
    n = len(mem)
    clusters = len(mem.clusters)
    sid = f"`{session.id}`" if is_session_id(session.id) else md_cell(session.id)
    return (
        f"Trajectories: **{n}** · clusters: **{clusters}** · "
        f"metric growth: **{session.metric.growth:.4f}** · turns: **{len(session.turns)}** · "
        f"session {sid}"
    )


def highlight_row(session: Any, columns: dict[str, Any]) -> int | None:
    """The stored trajectory of the latest query: itself if stored, else its nearest."""
    last = session.last_turn
    texts = list(columns.get("query_text", []))
    if not texts or last is None:
        return None
    user, bot = last.to_messages()
    for target in (user.get("text"), bot.get("nearest_query")):
        if target:
            for i in range(len(texts) - 1, -1, -1):
                if texts[i] == target:
                    return i
    return None


def counted(n: int, one: str, many: str | None = None) -> str:
    """``n`` with its noun, singular for one: "1 trajectory", "3 trajectories"."""
    return f"{n:,} {one if n == 1 else (many or one + 's')}"


def download_name(session_id: str, ext: str, when: float | None = None) -> str:
    """A download's file name: ``isagi-<session id>-<UTC date>.<ext>``, no words of the chat
    (a name travels in URLs, browser histories and server logs)."""
    import datetime as dt
    import time

    day = dt.datetime.fromtimestamp(time.time() if when is None else when, dt.UTC).strftime("%Y%m%d")
    return f"isagi-{session_id}-{day}.{ext}"


def verdict_alert(reply: dict[str, Any] | None) -> str:
    """The alert line after a turn: why nothing (or only part) was generated, or nothing."""
    verdict = (reply or {}).get("verdict")
    if verdict == "refused":
        return ("⚠️ This request was refused by the geometric safety layer (TEH over the threshold): "
                "nothing was generated.")
    if verdict == "withheld":
        return "⚠️ The reply was withheld: its TEH went over the threshold while it streamed."
    if verdict == "cancelled":
        return "Stopped: the generation was ended; the partial reply is kept."
    return ""
