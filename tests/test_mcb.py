"""MIKU Creativity Benchmark: deterministic scores that rank what they claim to rank."""

from __future__ import annotations

import numpy as np
import pytest

from isagi.explore.mcb import (
    WEIGHTS,
    Constraint,
    associative_breadth,
    bigram_novelty,
    divergent_thinking,
    figurative_markers,
    metaphor,
    narrative_originality,
    score_mcb,
    tier,
)

VARIED = [
    "The ocean is a tapestry of restless blue, folding light like a letter nobody sends.",
    "At night the harbour hums as if the tide remembers every ship it swallowed.",
    "Salt wind drags old songs across the dunes, quiet as a library after closing.",
]
REPETITIVE = [
    "The ocean is big. The ocean is big. The ocean is big.",
    "The ocean is big. The ocean is big. The ocean is big.",
    "The ocean is big. The ocean is big. The ocean is big.",
]
BASELINE = ["The ocean is big and blue. The ocean is big."]


def test_weights_sum_to_one() -> None:
    assert sum(WEIGHTS.values()) == pytest.approx(1.0)


def test_tiers_at_their_bounds() -> None:
    assert [tier(x) for x in (85, 84.99, 70, 55, 40, 39.99)] == ["S", "A", "A", "B", "C", "D"]


def test_scores_are_deterministic() -> None:
    kw = dict(seed="the ocean", baselines=BASELINE, constraint=Constraint("ocean", 60))
    assert score_mcb(VARIED, **kw) == score_mcb(list(VARIED), **kw)


def test_varied_metaphorical_text_ranks_above_repetitive_on_every_dimension() -> None:
    kw = dict(seed="the ocean", baselines=BASELINE, constraint=Constraint("ocean", 60))
    good, bad = score_mcb(VARIED, **kw), score_mcb(REPETITIVE, **kw)
    for dim in WEIGHTS:
        assert getattr(good, dim) > getattr(bad, dim), dim
    assert good.index > bad.index
    assert bad.tier == "D"
    assert 0.0 <= bad.index <= good.index <= 100.0


def test_divergent_thinking_is_distinct_n() -> None:
    assert divergent_thinking(["a b c d"]) == pytest.approx(100.0)
    assert divergent_thinking(["a a a a"]) == pytest.approx(100.0 * (1 / 4 + 1 / 3) / 2)
    assert divergent_thinking([""]) == 0.0


def test_associative_breadth_identical_units_is_zero_and_embeddings_are_used() -> None:
    assert associative_breadth(["red apple tree", "red apple tree"]) == 0.0
    assert associative_breadth(["red apple", "blue ocean"]) == pytest.approx(100.0)
    e = np.array([[1.0, 0.0], [0.0, 1.0]])
    assert associative_breadth(["x", "y"], e) == pytest.approx(100.0)
    assert associative_breadth(["x", "y"], np.array([[1.0, 0.0], [2.0, 0.0]])) == pytest.approx(0.0)
    with pytest.raises(ValueError):
        associative_breadth(["x", "y", "z"], e)


def test_originality_counts_bigrams_absent_from_the_baseline() -> None:
    assert bigram_novelty("the ocean is big", ["the ocean is big"]) == 0.0
    assert bigram_novelty("the ocean is wide", ["the ocean is big"]) == pytest.approx(1 / 3)
    assert narrative_originality(["purple kites sing"], ["the ocean is big"]) == 100.0


def test_constraint_checks_keyword_and_length() -> None:
    c = Constraint("ocean", 5)
    assert c.checks("Oceans glitter softly") == [True, True]
    assert c.checks("the sea is wide and very deep") == [False, False]
    refs = ["unrelated words only"]
    full = score_mcb(["oceans glitter softly"], baselines=refs, constraint=c).constraint_creativity
    half = score_mcb(["seas glitter softly"], baselines=refs, constraint=c).constraint_creativity
    assert full == pytest.approx(100.0) and half == pytest.approx(50.0)


def test_no_constraint_leaves_the_dimension_out_of_the_index() -> None:
    r = score_mcb(VARIED, baselines=BASELINE)
    assert r.constraint_creativity is None
    present = {k: getattr(r, k) for k in WEIGHTS if k != "constraint_creativity"}
    expected = sum(WEIGHTS[k] * v for k, v in present.items()) / sum(WEIGHTS[k] for k in present)
    assert r.index == pytest.approx(expected, abs=0.02)


def test_metaphor_markers() -> None:
    assert figurative_markers("Time is like a river.") == 1
    assert figurative_markers("as quiet as a mouse, as if asleep") == 2
    assert figurative_markers("she works as a teacher") == 0
    assert figurative_markers("a symphony of lights") == 1
    assert figurative_markers("Paris is the capital of France.") == 0
    assert metaphor(["Paris is the capital of France. It is large."]) == 0.0
    assert metaphor(["The city hums like a hive. Streets glow as if alive."]) == 100.0
