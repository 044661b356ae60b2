"""What the page says, without a browser: the README's plain tier names on badges, the Turn
panel, the map's legend and the help (technical names in tooltips and beside them), the real
range of d and the model's tier boundaries, the explorer's steering limit, the banner's
live-session count redrawn at each sync, "Signed in as" and Log out with a login, an honest
loading banner, the message box open only when the model can answer, and a login page for
the people who sign in.

The real handlers on the tiny engine (tests/tiny_engine.py), whose profile has the seed
distance scale (tier boundaries at d = 0.20 and 0.50)."""

from __future__ import annotations

import html
import re
import threading
import warnings
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest

from isagi.app import plots
from isagi.app.handlers.page import LOGOUT
from isagi.app.help_text import BADGE_HELP, FIGURE_HELP, PLAIN_NAMES
from isagi.app.loader import (
    CONVERTING,
    LOADING,
    EngineHolder,
    calibrating,
    first_stage,
)
from isagi.app.login import login_message
from isagi.app.render_safe import TIERS
from isagi.app.ui import WebUI
from isagi.app.views import info_html, pending_html
from isagi.config import load_settings
from isagi.manifold.cog import Metric
from isagi.session.registry import SessionRegistry
from isagi.session.service import SessionService
from tests.tiny_engine import tiny_engine

ROOT = Path(__file__).resolve().parents[1]


def run(gen):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # gr.Warning outside a request falls back to warnings
        return list(gen)


def make_ui(tmp_path: Path, **engine_kw) -> WebUI:
    engine = tiny_engine(tmp_path, max_new_tokens=8, **engine_kw)
    holder = EngineHolder(engine)
    return WebUI(holder, SessionService(SessionRegistry(lambda: holder.engine, idle_s=600)), engine.settings)


def req(user: str | None) -> SimpleNamespace:
    return SimpleNamespace(username=user, client=SimpleNamespace(host="10.0.0.1"), session_hash="page-1")


def shown_badges(html_text: str) -> list[tuple[str, str, str]]:
    """(class suffix, title, visible text) of every badge in ``html_text``."""
    found = re.findall(r'<span class="isagi-tier isagi-tier-(\w+)"(?: title="([^"]*)")?>([^<]*)</span>', html_text)
    return [(cls, html.unescape(title), html.unescape(text)) for cls, title, text in found]


# --------------------------------------------------------------------------- plain words


def test_the_tier_names_are_the_readmes_words():
    """The page's names of the four tiers are the README's, so what it promises is what it shows."""
    readme = (ROOT / "README.md").read_text()
    intro = readme.split("## Quick start")[0]
    assert f"**{PLAIN_NAMES['RETRIEVE']}** (tier RETRIEVE)" in intro
    related = "**" + " / ".join(PLAIN_NAMES[t].lower() if i else PLAIN_NAMES[t]
                                for i, t in enumerate(("AUGMENT", "EXPAND", "EXPLORE"))) + "**"
    assert related + " (tiers AUGMENT, EXPAND, EXPLORE)" in intro


@pytest.mark.parametrize("tier", TIERS)
def test_a_badge_shows_the_plain_name_and_the_technical_one_on_hover(tier):
    m = {"role": "assistant", "tier": tier, "verdict": "ok", "distance": 0.3, "teh_prompt": 1.0}
    (cls, title, text), = shown_badges(info_html(m))[:1]
    assert text == PLAIN_NAMES[tier] and tier not in text
    assert cls == tier.lower(), "the CSS class keeps the technical name"
    assert title.startswith(BADGE_HELP[tier]) and f"tier {tier}" in title
    assert shown_badges(pending_html(tier, 0.3))[0][2] == PLAIN_NAMES[tier]


def test_verdict_badges_and_stop_are_plain_too():
    refused = shown_badges(info_html({"verdict": "refused", "tier": None, "teh_prompt": 80.0}))
    assert [(c, t) for c, _, t in refused] == [("refused", "Refused")] and "verdict REFUSED" in refused[0][1]
    stopped = shown_badges(info_html({"verdict": "cancelled", "tier": "EXPAND"}))
    assert [(c, t) for c, _, t in stopped] == [("expand", "New"), ("cancelled", "Stopped")]
    assert shown_badges(pending_html(None, None))[0][2] == "Pending"


def test_the_turn_panel_names_the_tier_plainly_with_the_models_d_boundaries(tmp_path):
    ui = make_ui(tmp_path)
    sid = ui.page.registry.create()
    first = run(ui.chat.send("what is the capital of France?", sid, 4))[-1]
    again = run(ui.chat.send("what is the capital of France?", sid, 4))[-1]
    assert "| Tier | **New topic** (EXPLORE) |" in first.turn
    assert "| Tier | **Answered from memory** (RETRIEVE) |" in again.turn
    # the tiny profile's distance scale is the seed one: Related below 0.20, New topic from 0.50
    assert "Related below 0.200, New below 0.500, New topic above" in again.turn


def test_the_maps_legend_names_tiers_plainly_and_its_hover_adds_the_technical_name():
    cols = {"query_x": np.eye(4), "query_text": list("abcd"), "tier": ["RETRIEVE", "AUGMENT", "EXPAND", "EXPLORE"]}
    traces = plots.map_figure(cols).data
    assert [t.name for t in traces] == [PLAIN_NAMES[t] for t in TIERS]
    assert "Related (AUGMENT)" in traces[1].hovertemplate


def test_d_as_the_help_describes_it_runs_from_0_to_2():
    """The help's range of d is the range of the distance the page shows (the metric cosine
    distance): opposite states are 2 apart, not 1."""
    metric = Metric(4)
    x = np.array([1.0, 2.0, 0.5, -1.0])
    assert metric.distance(x, x) == pytest.approx(0.0, abs=1e-12)
    assert metric.distance(x, -x) == pytest.approx(2.0)
    assert "0 = the same" in FIGURE_HELP["d"] and "up to 2" in FIGURE_HELP["d"]
    assert "1 = unrelated)" not in FIGURE_HELP["d"]


def test_the_explorers_limit_is_explained_beside_it_and_told_apart_from_the_chats():
    from isagi.app.handlers.explore import limit_note

    note = limit_note(15.8, 41.2)
    assert "15.8 %" in note and "forbidden directions" in note and "ordinary reply" in note
    assert "41.2 %" in note, "the chat's refusal threshold is named as a different score"
    fig = plots.explore_figure([{"step": 1, "teh": 3.0, "alpha": 0.2}], 15.8)
    assert "steering limit 15.8%" in fig.layout.annotations[0].text


# --------------------------------------------------------------------------- the banner


def test_the_sync_redraws_the_live_session_count(tmp_path):
    """A page that has no session yet still shows the server's count as it is now: another
    page's first message makes a session, and this page's next sync says 1, not 0."""
    ui = make_ui(tmp_path)
    assert "0 live session(s)" in ui.chat.on_load(None).status
    other = run(ui.chat.send("hello", None, 4))[-1]
    assert other.state in ui.page.registry
    assert "1 live session(s)" in ui.chat.sync_with_status(None, None).status


def test_signed_in_and_log_out_only_with_a_login(tmp_path):
    ui = make_ui(tmp_path / "open")
    assert "Signed in" not in ui.chat.on_load(None, request=req(None)).status
    ui = make_ui(tmp_path / "auth", auth="alice:a,bob:b")
    status = ui.chat.on_load(None, request=req("alice")).status
    assert "Signed in as **alice**" in status and "bob" not in status
    # the Log out button goes to Gradio's logout route, for this browser only
    assert LOGOUT.startswith("logout?") and "all_session=false" in LOGOUT
    assert "Signed in as **bob**" in ui.chat.sync_with_status(None, None, request=req("bob")).status


def test_the_loading_banner_says_what_the_loader_does_and_the_box_opens_only_when_ready(tmp_path):
    settings = tiny_engine(tmp_path).settings
    loading, calibrate, calibrating_now, finish = (threading.Event() for _ in range(4))

    def factory(progress):
        progress(LOADING, 0, 1)
        loading.set()
        calibrate.wait(30)
        calibrating(progress)("UGT basis: hidden states of the zone corpus", 3, 40)
        calibrating_now.set()
        finish.wait(30)
        return tiny_engine(tmp_path)

    holder = EngineHolder(factory)
    ui = WebUI(holder, SessionService(SessionRegistry(lambda: holder.engine)), settings)
    holder.start()
    assert loading.wait(30)
    banner = ui.page.status_line()
    assert LOADING in banner and "alibrat" not in banner and "onvert" not in banner, banner
    assert [c.interactive for c in ui.page.input_open()] == [False, False]
    calibrate.set()
    assert calibrating_now.wait(30)
    assert "Calibrating the model" in ui.page.status_line() and "(3/40)" in ui.page.status_line()
    assert [c.interactive for c in ui.page.input_open()] == [False, False]
    finish.set()
    assert holder.wait(30)
    assert [c.interactive for c in ui.page.input_open()] == [True, True]
    ready = ui.chat.on_tick(None)
    assert ready.alert == "" and ready.timer.active is False, "the ready tick leaves no stale alert"


def test_a_failed_load_keeps_the_box_closed(tmp_path):
    settings = tiny_engine(tmp_path).settings

    def factory(progress):
        raise RuntimeError("no such model")

    holder = EngineHolder(factory)
    ui = WebUI(holder, SessionService(SessionRegistry(lambda: holder.engine)), settings)
    holder.start()
    holder.wait(30)
    assert holder.failed and [c.interactive for c in ui.page.input_open()] == [False, False]


def test_first_stage_says_converting_only_when_it_converts(tmp_path):
    llama = load_settings(environ={}, home=tmp_path, backend="llamacpp")
    assert first_stage(llama) == LOADING, "the embedded model on llama.cpp ships its profile: it only loads"
    hf = load_settings(environ={}, home=tmp_path, backend="transformers")
    assert first_stage(hf) == CONVERTING
    converted = hf.models_dir / "smollm2-135m-instruct-0123456789abcdef"
    converted.mkdir(parents=True)
    (converted / "model.safetensors").write_bytes(b"")
    assert first_stage(hf) == LOADING


# --------------------------------------------------------------------------- the login page


def test_the_login_page_speaks_to_the_people_who_sign_in():
    text = login_message(5, 60.0)
    assert "ISAGI" in text and "Sign in" in text
    assert "ISAGI_AUTH" not in text and "environment" not in text, "setting logins up is the operator's"
    assert "5 failed attempts" in text and "60 s" in text
