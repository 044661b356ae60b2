"""The manifold panel's figures (plotly), computed from a Session's own state.

Owns: metric growth over turns, TEH of prompt and reply over turns (with the
profile's threshold), the 2-D map of the session's stored trajectories (a PCA
projection of their k-dimensional UGT query coordinates, coloured by tier or
by cluster, the current query highlighted) and the exploration chart.
Nothing here touches the model; every function takes plain data and returns a
``plotly.graph_objects.Figure`` sized for a laptop screen.
"""

from __future__ import annotations

import functools
from typing import Any

import numpy as np

from isagi.app.help_text import PLAIN_NAMES, plain_name
from isagi.app.render_safe import hover_text

TIER_COLOURS = {
    "RETRIEVE": "#187a3f",
    "AUGMENT": "#1f6aa0",
    "EXPAND": "#7b3294",
    "EXPLORE": "#b34d00",
}  # the badges' colours (app.layout CSS)
CLEAR = "rgba(0,0,0,0)"
MID_GREY = "#808080"  # lines and rings drawn over both themes: at least 3:1 against white and near-black
HEIGHT = 300


@functools.cache
def _white() -> Any:
    """plotly's ``plotly_white`` look, its layout part only, as a template made once, on a
    transparent paper and plot: the figure shows on the page's own background, light or dark
    (in dark mode the page's CSS gives its texts and grid the page's colours).

    Setting ``template="plotly_white"`` validates the whole template (defaults
    for two dozen trace types) again for every figure, three figures per turn,
    taking the cores the model's threads need while another session's reply
    is being decoded; this one applies at a fraction of that
    (docs/measurements.md).
    """
    import plotly.graph_objects as go

    axis = {"gridcolor": "#EBF0F8", "linecolor": "#EBF0F8", "zerolinecolor": "#EBF0F8", "zerolinewidth": 2,
            "ticks": "", "automargin": True, "title": {"standoff": 15}}
    return go.layout.Template(
        layout={
            "colorway": ["#636efa", "#EF553B", "#00cc96", "#ab63fa", "#FFA15A", "#19d3f3", "#FF6692", "#B6E880",
                         "#FF97FF", "#FECB52"],
            "font": {"color": "#2a3f5f"}, "hovermode": "closest", "hoverlabel": {"align": "left"},
            "paper_bgcolor": CLEAR, "plot_bgcolor": CLEAR, "xaxis": axis, "yaxis": axis, "title": {"x": 0.05},
        },
        data={"bar": [{"marker": {"line": {"color": "white", "width": 0.5}}}]},
    )


def _layout(fig: Any, title: str, xaxis: str, yaxis: str) -> Any:
    fig.update_layout(
        title={"text": title, "font": {"size": 14}},
        template=_white(),
        height=HEIGHT,
        margin={"l": 50, "r": 15, "t": 40, "b": 40},
        xaxis_title=xaxis,
        yaxis_title=yaxis,
        legend={"orientation": "h", "y": -0.25, "font": {"size": 11}},
        font={"size": 12},
    )
    return fig


def _turn_axes(fig: Any, x: list[float], ys: list[float], *, start: float = 0.5) -> Any:
    """Axes that read well with any number of turns, one or two included.

    Turns are whole numbers: the x axis spans ``start`` to the last turn plus
    a half, with a tick per turn up to 20 turns. The y axis starts at 0 and
    leaves headroom above the largest finite value (at least 1 unit), so a
    single point sits inside the plot instead of on an autoscaled sliver.
    """
    last = max(x) if x else 1
    fig.update_xaxes(range=[start, last + 0.5], dtick=1 if last - start <= 21 else None)
    finite = [v for v in ys if v is not None and np.isfinite(v)]
    top = max(finite) if finite else 0.0
    fig.update_yaxes(range=[0.0, max(1.0, top) * 1.15])
    return fig


def _num(v: Any, default: float = float("nan")) -> float:
    """A value from a session log as a number for a plot (anything else: ``default``)."""
    if v is None or isinstance(v, bool):
        return default
    try:
        return float(v)
    except (TypeError, ValueError, OverflowError):
        return default


def turn_rows(messages: list[dict[str, Any]], first_turn: int = 1) -> list[dict[str, Any]]:
    """The assistant entries of a conversation log, numbered by turn from ``first_turn``
    (the number of the log's first turn in its session: a window's numbers are the session's)."""
    rows = []
    turn = first_turn - 1
    for m in messages:
        if m.get("role") == "user":
            turn += 1
        elif m.get("role") == "assistant":
            rows.append({**m, "turn": turn})
    return rows


def growth_figure(messages: list[dict[str, Any]], first_turn: int = 1) -> Any:
    """‖M − I‖_F after each turn (``first_turn``: the number of the log's first turn)."""
    import plotly.graph_objects as go

    rows = turn_rows(messages, first_turn)
    x = [r["turn"] for r in rows]
    y = [_num(r.get("metric_growth"), 0.0) for r in rows]
    tiers = [hover_text(_short(_plain(r.get("tier") or r.get("verdict") or ""), 24)) for r in rows]
    if first_turn == 1:  # the whole session: from the identity metric at turn 0
        x0, y0, t0 = [0], [0.0], ["start"]
    else:
        x0, y0, t0 = [], [], []
    fig = go.Figure(
        go.Scatter(
            x=[*x0, *x], y=[*y0, *y], mode="lines+markers", name="growth",
            text=[*t0, *tiers], hovertemplate="turn %{x}: %{y:.4f} (%{text})<extra></extra>",
            line={"color": "#2c7fb8"},
        )
    )
    _layout(fig, "Metric growth ‖M − I‖ over turns", "turn", "growth")
    return _turn_axes(fig, x, y, start=first_turn - 1.5)


def teh_figure(messages: list[dict[str, Any]], threshold: float | None = None, first_turn: int = 1) -> Any:
    """TEH of the prompt and of the reply per turn (%), with the refusal threshold
    (``first_turn``: the number of the log's first turn)."""
    import plotly.graph_objects as go

    rows = turn_rows(messages, first_turn)
    x = [r["turn"] for r in rows]
    fig = go.Figure()
    plotted: list[float] = []
    for key, name, colour in (("teh_prompt", "prompt", "#d7301f"), ("teh_reply", "reply", "#fc8d59")):
        y = [r.get(key) for r in rows]
        plotted += [_num(v) for v in y]
        fig.add_trace(
            go.Scatter(
                x=x, y=[_num(v) for v in y], mode="lines+markers",
                name=f"TEH {name}", line={"color": colour}, connectgaps=False,
                hovertemplate=f"turn %{{x}}: {name} %{{y:.2f}}%<extra></extra>",
            )
        )
    if threshold is not None:
        fig.add_hline(
            y=float(threshold), line_dash="dash", line_color=MID_GREY,
            annotation_text=f"threshold {float(threshold):.1f}%", annotation_position="top left",
        )
    _layout(fig, "TEH over turns", "turn", "TEH (%)")
    return _turn_axes(fig, x, [*plotted, float(threshold) if threshold is not None else 0.0],
                      start=first_turn - 0.5)


def pca_2d(X: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """Rows of ``X`` (n, k) projected on their first two principal axes; and the
    fraction of variance each axis explains. Fewer than two axes are padded with 0."""
    X = np.asarray(X, dtype=np.float64)
    n = X.shape[0]
    Y = np.zeros((n, 2))
    explained = np.zeros(2)
    if n < 2:
        return Y, explained
    C = X - X.mean(axis=0, keepdims=True)
    U, s, _ = np.linalg.svd(C, full_matrices=False)
    m = min(2, s.shape[0])
    Y[:, :m] = U[:, :m] * s[:m]
    total = float((s**2).sum())
    if total > 0:
        explained[:m] = (s[:m] ** 2) / total
    # A deterministic orientation: the largest |coordinate| of each axis is positive.
    for j in range(m):
        if Y[np.argmax(np.abs(Y[:, j])), j] < 0:
            Y[:, j] = -Y[:, j]
    return Y, explained


def _plain(label: Any) -> str:
    """A turn's tier or verdict as the page names it (the badge's plain name), else as it is."""
    text = str(label)
    return plain_name(text.upper()) if text.upper() in PLAIN_NAMES else text


def _short(text: Any, n: int = 60) -> str:
    text = " ".join(str(text).split())
    return text if len(text) <= n else text[: n - 1] + "…"


def map_figure(columns: dict[str, Any], *, colour_by: str = "tier", highlight: int | None = None,
               total: int | None = None) -> Any:
    """2-D map of stored trajectories: PCA of ``query_x``; ``highlight`` is a row to mark;
    ``total``: how many the session stores when ``columns`` are only its newest."""
    import plotly.graph_objects as go

    qx = np.asarray(columns.get("query_x", np.zeros((0, 2))), dtype=np.float64)
    n = int(qx.shape[0]) if qx.ndim == 2 else 0
    fig = go.Figure()
    if n == 0:
        fig.add_annotation(
            text="No stored trajectories yet: ask something new.", showarrow=False,
            x=0.5, y=0.5, xref="paper", yref="paper", font={"size": 13, "color": "#666"},
        )
        _layout(fig, "Trajectory map (0 trajectories)", "PC 1", "PC 2")
        fig.update_xaxes(visible=False)
        fig.update_yaxes(visible=False)
        return fig
    Y, explained = pca_2d(qx)
    # Titles and queries can come from an uploaded file: plotly renders some HTML in hover texts.
    texts = [hover_text(_short(t)) for t in columns.get("query_text", [""] * n)]
    if colour_by == "cluster":
        groups = [f"cluster {int(c)}" for c in columns.get("cluster", [0] * n)]
        palette = ["#1b9e77", "#d95f02", "#7570b3", "#e7298a", "#66a61e", "#e6ab02", "#a6761d", "#666666"]
        keys = sorted(set(groups), key=lambda g: int(g.split()[1]))
        colours = {g: palette[i % len(palette)] for i, g in enumerate(keys)}
    else:
        groups = [t if t in TIER_COLOURS else "?" for t in (str(t) for t in columns.get("tier", ["?"] * n))]
        keys = [t for t in TIER_COLOURS if t in set(groups)] + sorted(set(groups) - set(TIER_COLOURS))
        colours = {g: TIER_COLOURS.get(g, "#888888") for g in keys}
    groups_arr = np.asarray(groups)
    for g in keys:
        idx = np.flatnonzero(groups_arr == g)
        # a tier's legend entry is its plain name; its hover adds the technical one
        name = plain_name(g) if g in TIER_COLOURS else g
        extra = f"{name} ({g})" if name != g else g
        fig.add_trace(
            go.Scatter(
                x=Y[idx, 0], y=Y[idx, 1], mode="markers", name=name,
                marker={"size": 10, "color": colours[g], "line": {"width": 1, "color": "white"}},
                text=[texts[i] for i in idx], hovertemplate="%{text}<extra>" + extra + "</extra>",
            )
        )
    if highlight is not None and 0 <= highlight < n:
        fig.add_trace(
            go.Scatter(
                x=[Y[highlight, 0]], y=[Y[highlight, 1]], mode="markers", name="current query",
                marker={"size": 20, "symbol": "circle-open", "color": MID_GREY, "line": {"width": 3}},
                text=[texts[highlight]], hovertemplate="current: %{text}<extra></extra>",
            )
        )
    # One or two points: PCA has (almost) no spread; centre them in a fixed frame.
    span = float(np.abs(Y).max()) if n else 0.0
    if n <= 2 or span < 1e-9:
        r = max(span * 1.5, 1.0)
        fig.update_xaxes(range=[-r, r])
        fig.update_yaxes(range=[-r, r])
    word = "trajectory" if n == 1 else "trajectories"
    shown = f"{n} {word}" if total is None or total <= n else f"newest {n:,} of {total:,} trajectories"
    _layout(
        fig, f"Trajectory map ({shown}, PCA of k-space)",
        f"PC 1 ({explained[0]:.0%})", f"PC 2 ({explained[1]:.0%})",
    )
    return fig


def explore_figure(steps: list[dict[str, Any]], threshold: float | None = None) -> Any:
    """TEH of each exploration step (bars: the share of its reply's state in the forbidden
    directions) with the step size α (line, right axis) and ``threshold``, the profile's window
    limit on that share (above every ordinary calibration reply; not the chat's refusal threshold)."""
    import plotly.graph_objects as go

    x = [int(s.get("step", i + 1)) for i, s in enumerate(steps)]
    teh = [float(s.get("teh", 0.0) or 0.0) for s in steps]
    alpha = [s.get("alpha") for s in steps]
    fig = go.Figure(go.Bar(x=x, y=teh, name="TEH (%)", marker_color="#fc8d59"))
    if any(a is not None for a in alpha):
        fig.add_trace(
            go.Scatter(x=x, y=alpha, name="α", yaxis="y2", mode="lines+markers", line={"color": "#2c7fb8"})
        )
        fig.update_layout(yaxis2={"title": "α", "overlaying": "y", "side": "right", "rangemode": "tozero"})
    if threshold is not None:
        fig.add_hline(y=float(threshold), line_dash="dash", line_color=MID_GREY,
                      annotation_text=f"steering limit {float(threshold):.1f}% (above every ordinary reply)")
    _layout(fig, "Exploration: TEH per step", "step", "TEH (%)")
    return fig
