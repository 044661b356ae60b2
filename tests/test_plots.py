"""The manifold panel's figures read well with one or two turns (sane axes)."""

from __future__ import annotations

import numpy as np

from isagi.app.plots import growth_figure, map_figure, teh_figure


def _msgs(n: int, teh: float = 3.0, growth: float = 0.012) -> list[dict]:
    out = []
    for i in range(n):
        out += [{"role": "user", "content": f"q{i}"},
                {"role": "assistant", "content": "a", "teh_prompt": teh, "teh_reply": teh / 2,
                 "metric_growth": growth * (i + 1), "tier": "EXPAND"}]
    return out


def test_one_turn_teh_plot_has_whole_turn_axis_and_threshold_in_view():
    fig = teh_figure(_msgs(1, teh=3.0), threshold=13.8)
    x0, x1 = fig.layout.xaxis.range
    assert x0 < 1 < x1 and x1 - x0 <= 2  # the single turn sits inside, no fractional turns around it
    assert fig.layout.xaxis.dtick == 1
    y0, y1 = fig.layout.yaxis.range
    assert y0 == 0 and y1 > 13.8  # the threshold line is visible, not autoscaled away


def test_growth_plot_starts_at_zero_and_spans_the_turns():
    fig = growth_figure(_msgs(2, growth=0.01))
    x0, x1 = fig.layout.xaxis.range
    assert x0 < 0 < 2 < x1
    y0, y1 = fig.layout.yaxis.range
    assert y0 == 0 and y1 >= 0.02


def test_many_turns_drop_the_per_turn_tick():
    fig = teh_figure(_msgs(25))
    assert fig.layout.xaxis.dtick is None and fig.layout.xaxis.range[1] == 25.5


def test_map_with_one_or_two_points_has_a_fixed_frame():
    for n in (1, 2):
        cols = {"query_x": np.ones((n, 8)) * np.arange(n)[:, None], "query_text": ["q"] * n, "tier": ["EXPAND"] * n}
        fig = map_figure(cols)
        r0, r1 = fig.layout.xaxis.range
        assert r0 < 0 < r1 and r1 - r0 >= 2
        pts = np.concatenate([np.asarray(t.x, dtype=float) for t in fig.data])
        assert np.all((pts >= r0) & (pts <= r1))


def test_every_badge_and_figure_of_a_reply_explains_itself_on_hover():
    import re

    from isagi.app.help_text import BADGE_HELP, help_markdown
    from isagi.app.views import info_html

    m = {"role": "assistant", "tier": "AUGMENT", "verdict": "ok", "distance": 0.12, "nearest_query": "q",
         "zone": "science", "teh_prompt": 2.0, "teh_reply": 1.0, "latency_s": 0.5, "new_tokens": 5,
         "prompt_tokens": 40}
    html_out = info_html(m)
    titles = re.findall(r'title="([^"]+)"', html_out)
    assert len(titles) == 6 and all(len(t) > 20 for t in titles)  # badge, d, zone, TEH, latency, tokens
    assert "Related" in titles[0]
    assert info_html({**m, "verdict": "refused"}).count("Refused:") == 1
    panel = help_markdown()
    for tier, plain in (("RETRIEVE", "Answered from memory"), ("AUGMENT", "Related"), ("EXPAND", "New"),
                        ("EXPLORE", "New topic"), ("REFUSED", "Refused"), ("WITHHELD", "Withheld")):
        assert f"**{plain}** ({tier})" in panel and tier in BADGE_HELP  # the README's word, then the tier's


def test_figures_are_see_through_so_they_follow_the_page_theme():
    """Paper and plot are transparent (the page's light or dark background shows), and the
    lines drawn over them are a grey visible on both."""
    from isagi.app.plots import CLEAR, MID_GREY

    cols = {"query_x": np.eye(3, 8), "query_text": ["q"] * 3, "tier": ["EXPAND"] * 3}
    for fig in (growth_figure(_msgs(2)), teh_figure(_msgs(2), threshold=5.0), map_figure(cols, highlight=0)):
        bg = {fig.layout.paper_bgcolor, fig.layout.plot_bgcolor} - {None}  # none set over the template's
        template = fig.layout.template.layout
        assert {template.paper_bgcolor, template.plot_bgcolor} == {CLEAR} and bg <= {CLEAR}
    shapes = teh_figure(_msgs(2), threshold=5.0).layout.shapes
    assert shapes and all(s.line.color == MID_GREY for s in shapes)
