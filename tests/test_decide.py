"""The tier rule (isagi.manifold.decide.decide) as a pure function: no model, no session."""

from __future__ import annotations

import copy
import dataclasses

import pytest

from isagi.manifold.cog import Tier
from isagi.manifold.decide import Candidate, Decision, decide
from isagi.manifold.distance_scale import SEED, DistanceScale
from isagi.manifold.sameness import content_key

CAPITAL = "What is the capital of France?"


def record(query: str, *, context_key: str = "", reply: str = "stored reply", cluster: int = 3) -> dict:
    return {"query_text": query, "reply_text": reply, "cluster": cluster,
            "content_key": content_key(query), "context_key": context_key}


def test_an_empty_memory_is_explore_with_no_distance() -> None:
    d = decide([], CAPITAL, "", SEED)
    assert isinstance(d, Decision) and not isinstance(d, tuple)
    assert (d.tier, d.nearest, d.distance, d.record, d.context_dependent) == (Tier.EXPLORE, None, None, None, False)


def test_the_same_question_within_the_cap_is_retrieve() -> None:
    c = Candidate(7, 0.01, record("what is the capital of france"))
    d = decide([c], CAPITAL, "", SEED)
    assert d.tier is Tier.RETRIEVE and d.nearest is c and d.distance == 0.01


def test_retrieve_takes_the_matching_candidate_even_when_it_is_not_the_nearest() -> None:
    near = Candidate(1, 0.001, record("What is the capital of Germany?"))
    match = Candidate(2, 0.04, record(CAPITAL))
    d = decide([near, match], CAPITAL, "", SEED)
    assert d.tier is Tier.RETRIEVE and d.nearest is match


def test_the_same_question_beyond_the_cap_is_not_retrieve() -> None:
    d = decide([Candidate(1, SEED.retrieve_cap + 0.01, record(CAPITAL))], CAPITAL, "", SEED)
    assert d.tier is Tier.AUGMENT, "close, related, but too far for the exact answer"


def test_a_near_miss_at_distance_zero_is_augment_never_retrieve() -> None:
    d = decide([Candidate(1, 0.0, record("What is the capital of Germany?"))], CAPITAL, "", SEED)
    assert d.tier is Tier.AUGMENT and d.distance == 0.0


@pytest.mark.parametrize("distance, tier", [(0.1, Tier.AUGMENT), (0.19, Tier.AUGMENT), (0.2, Tier.EXPAND),
                                            (0.3, Tier.EXPAND), (0.5, Tier.EXPLORE), (1.2, Tier.EXPLORE)])
def test_the_nearest_distance_gives_the_band(distance: float, tier: Tier) -> None:
    d = decide([Candidate(1, distance, record("How do plants make food?"))], CAPITAL, "", SEED)
    assert d.tier is tier and d.distance == distance


def test_the_bands_are_on_the_rescaled_distance() -> None:
    wide = DistanceScale(augment_at=0.4, explore_at=1.0, retrieve_cap=0.05, report={})
    c = Candidate(1, 0.3, record("How do plants make food?"))
    assert decide([c], CAPITAL, "", SEED).tier is Tier.EXPAND
    assert decide([c], CAPITAL, "", wide).tier is Tier.AUGMENT


def test_a_follow_up_is_retrieved_only_in_its_own_context() -> None:
    spain = content_key("What is the capital of Spain?")
    stored = Candidate(1, 0.0, record("And Germany?", context_key=spain))
    same = decide([stored], "And Germany?", spain, SEED)
    assert same.context_dependent and same.tier is Tier.RETRIEVE
    other = decide([stored], "And Germany?", content_key("How many people live in Japan?"), SEED)
    assert other.context_dependent and other.tier is Tier.AUGMENT


def test_a_record_stored_with_a_context_needs_that_context() -> None:
    stored = Candidate(1, 0.0, record(CAPITAL, context_key="something else"))
    assert decide([stored], CAPITAL, "", SEED).tier is Tier.AUGMENT
    assert decide([stored], CAPITAL, "something else", SEED).tier is Tier.RETRIEVE


def test_decide_is_pure() -> None:
    cands = [Candidate(1, 0.3, record("How do plants make food?")), Candidate(2, 0.04, record(CAPITAL))]
    before = copy.deepcopy(cands)
    first = decide(cands, CAPITAL, "", SEED)
    assert decide(cands, CAPITAL, "", SEED) == first
    assert cands == before, "the candidates and their records are not changed"
    with pytest.raises(dataclasses.FrozenInstanceError):
        first.tier = Tier.EXPLORE  # type: ignore[misc]
