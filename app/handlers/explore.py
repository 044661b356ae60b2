"""The concept explorer's handler: a Safe OGD chain from a seed, with the TEH of every step
and the MIKU creativity index, through the same entry point as ``isagi explore``
(:func:`isagi.explore.chains.explore_on`, with the calibrated system prompt).

A step's TEH is not the chat's: it is the share of the step's reply state in the forbidden
directions (:mod:`isagi.explore.chains`), and its limit is the profile's window threshold (above
every ordinary calibration reply), not the chat's refusal threshold, which reads the probe's
score. The page says so beside the figure (:func:`limit_note`)."""

from __future__ import annotations

from isagi.app import plots
from isagi.app.handlers.page import Page
from isagi.app.loader import EngineLoading
from isagi.app.render_safe import md_cell
from isagi.app.updates import PageUpdate
from isagi.app.views import fmt, short


def limit_note(limit: float | None, chat_threshold: float | None) -> str:
    """What the explorer's TEH and its dashed limit are, in plain words, beside the figure."""
    if limit is None:
        return ""
    chat = (f" The chat's refusal threshold ({chat_threshold:.1f} %) reads another score, the safety "
            "probe's, so the two numbers differ." if chat_threshold is not None else "")
    return (f"Each step's TEH here is the share of its reply's state that lies in the forbidden directions; "
            f"the dashed line at {limit:.1f} % is the steering limit, above every ordinary reply of the "
            f"model's calibration, so a step over it (⚠) was steered further into those directions than "
            f"any ordinary reply goes.{chat}")


class ExploreHandlers:
    """The explorer tab's one event (outputs :data:`~app.updates.EXPLORE`)."""

    def __init__(self, page: Page) -> None:
        self.page = page

    def run(self, seed: str, steps: float, max_tokens: float) -> PageUpdate:
        """Safe OGD exploration from a seed: steps with TEH, and the MIKU creativity index."""
        try:
            from isagi.explore.chains import explore_on
        except ImportError as exc:
            return PageUpdate(ex_steps=self.page.warn(f"Exploration is not available in this build ({exc})."),
                              mcb="")
        from isagi.errors import IsagiError

        try:
            result = explore_on(self.page.engine, seed or "", steps=int(steps), max_new_tokens=int(max_tokens))
        except (IsagiError, EngineLoading, ValueError) as exc:
            return PageUpdate(ex_steps=self.page.warn(str(exc)), mcb="")
        data = result.to_dict()
        steps_out = data.get("steps", [])
        lines = ["| step | α | TEH mean / max | coherence | text |", "|---|---|---|---|---|"]
        for i, st in enumerate(steps_out, 1):
            txt = md_cell(short(st.get("text", ""), 160))
            flag = " ⚠" if st.get("over_threshold") else ""
            lines.append(
                f"| {st.get('index', i)} | {fmt(st.get('alpha'), 2)} | {fmt(st.get('teh'), 2, '%')} / "
                f"{fmt(st.get('teh_max'), 2, '%')}{flag} | {fmt(st.get('coherence'), 2)} | {txt} |"
            )
        rows = [{"step": st.get("index", i), "teh": st.get("teh"), "alpha": st.get("alpha")}
                for i, st in enumerate(steps_out, 1)]
        limit = data.get("reply_threshold")
        fig = plots.explore_figure(rows, limit)
        safety = self.page.safety()
        note = limit_note(limit if isinstance(limit, (int, float)) else None,
                          safety.threshold if safety is not None else None)
        mcb = data.get("mcb") or {}
        dims = ", ".join(
            f"{k.replace('_', ' ')} {fmt(v, 1)}" for k, v in mcb.items() if k not in ("index", "tier")
        )
        mode = "Safe OGD (steps projected off the forbidden subspace)" if data.get("safe", True) else "regular OGD"
        mcb_md = (
            f"### MIKU creativity index: **{fmt(mcb.get('index'), 1)}** (tier {md_cell(mcb.get('tier', '–'))})\n\n"
            f"{dims}\n\n{mode}; baseline (unsteered): “{md_cell(short(data.get('baseline'), 200))}”"
            + (f"\n\n{note}" if note else "")
        )
        return PageUpdate(ex_steps="\n".join(lines), ex_plot=fig, mcb=mcb_md)
