"""``isagi bench turn --history``: its sessions, questions and figures, on the tiny model."""

from __future__ import annotations

from pathlib import Path

import pytest
from typer.testing import CliRunner

from isagi.bench.turn import NEW_QUESTIONS, history_exchanges, run_history
from isagi.manifold.sameness import content_key
from tests.tiny_engine import tiny_lm, tiny_profile, tiny_settings


def test_the_earlier_exchanges_and_the_new_questions_never_repeat() -> None:
    earlier = history_exchanges(1000)
    keys = {content_key(q) for q, _ in earlier}
    assert len(keys) == 1000 and len({r for _, r in earlier}) == 1000
    new = {content_key(q) for q in NEW_QUESTIONS}
    assert len(new) == len(NEW_QUESTIONS) and not new & keys, "no new question is RETRIEVEd"
    assert history_exchanges(7) == earlier[:7], "the same sessions on every run"


def test_one_run_measures_every_history_with_ratios_to_the_smallest(tmp_path: Path) -> None:
    settings = tiny_settings(tmp_path, prompt_token_budget=700, max_message_tokens=100)
    got = run_history(settings, [40, 0, 5], new_tokens=12, turns=8, lm=tiny_lm(), profile=tiny_profile())
    assert [k for k in got if k.startswith(("history_", "ratio_"))] == [
        "history_0", "history_5", "history_40", "ratio_5_to_0", "ratio_40_to_0"]
    empty, long = got["history_0"], got["history_40"]
    assert empty["min_s"] <= empty["median_s"] <= empty["max_s"] and empty["min_s"] <= empty["mean_s"] <= empty["max_s"]
    assert got["ratio_40_to_0"] == {k: round(long[k] / empty[k], 3) for k in ("median_s", "mean_s", "max_s")}
    assert long["prompt_tokens_median"] <= 700 and long["prompt_tokens_median"] > empty["prompt_tokens_median"]
    # 40 earlier exchanges are far past the budget: the window dropped blocks while it was measured
    assert long["drop_turns"] >= 1 and long["drop_turn_s"] is not None
    assert empty["evaluated_tokens_median"] is None, "transformers has no evaluated-token counter"
    assert long["context_shifts"] == 0 and got["context_shift"] is True, "nor a KV cache kept between turns"


def test_bad_history_lists_get_a_one_line_error(tmp_path: Path) -> None:
    import isagi.cli as cli

    for bad in ("10,x", "-1", ","):
        result = CliRunner().invoke(cli.app, ["bench", "turn", "--history", bad, "--home", str(tmp_path)])
        assert result.exit_code != 0 and "Traceback" not in result.output
        assert "whole numbers of 0 or more" in result.output, result.output


@pytest.mark.parametrize("turns", [1, len(NEW_QUESTIONS)])
def test_turns_outside_the_questions_are_refused(tmp_path: Path, turns: int) -> None:
    from isagi.errors import InputError

    with pytest.raises(InputError, match="new turns per session"):
        run_history(tiny_settings(tmp_path), [0], turns=turns, lm=tiny_lm(), profile=tiny_profile())
