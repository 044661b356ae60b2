"""The project's own data files: valid, balanced, held-out set disjoint, not copied.

These files decide whether the memory is safe, so their shape is checked
here and the sameness of their pairs in tests/test_sameness.py.
"""

from __future__ import annotations

import csv
import json
import re
from collections import Counter

import pytest

from isagi.data import (
    RELATIONS,
    ZONES,
    load_followups,
    load_jsonl,
    load_pairs,
    load_zones,
)
from isagi.errors import InputError
from isagi.evals.sets import benchmark_sources
from isagi.manifold.sameness import content_key

PAIR_SETS = ("calibration", "test")


def _norm(text: str) -> str:
    return " ".join(re.findall(r"[a-z0-9]+", text.lower()))


def _pair_texts(name: str) -> list[str]:
    return [t for r in load_pairs(name) for t in (r["first"], r["second"])]


def _followup_texts() -> list[str]:
    out: list[str] = []
    for r in load_followups():
        out += [*r["context_a"], r["followup"], *r["context_b"]]
    return out


def _all_texts() -> list[str]:
    texts = [r["text"] for r in load_zones()] + _followup_texts()
    for name in PAIR_SETS:
        texts += _pair_texts(name)
    return texts


def test_zones_are_valid_balanced_and_unique() -> None:
    rows = load_zones()
    assert len(rows) >= 360
    for r in rows:
        assert set(r) == {"text", "zone"}
        assert isinstance(r["text"], str) and r["text"] == r["text"].strip()
        assert 3 <= len(r["text"].split()) <= 40, r["text"]
    counts = Counter(r["zone"] for r in rows)
    assert set(counts) == set(ZONES)
    assert min(counts.values()) >= 60, counts
    # no duplicate prompts, not even up to case/punctuation/filler
    keys = Counter(content_key(r["text"]) for r in rows)
    assert [k for k, n in keys.items() if n > 1] == []


def test_zone_prompts_vary_in_length() -> None:
    lengths = [len(r["text"].split()) for r in load_zones()]
    assert min(lengths) <= 5 and max(lengths) >= 25
    # no single opening dominates a zone (variety matters for the SVD basis)
    for zone in ZONES:
        firsts = Counter(r["text"].split()[0].lower() for r in load_zones() if r["zone"] == zone)
        total = sum(firsts.values())
        assert firsts.most_common(1)[0][1] <= 0.5 * total, (zone, firsts.most_common(3))


@pytest.mark.parametrize("name", PAIR_SETS)
def test_pairs_are_valid_and_counts_hold(name: str) -> None:
    rows = load_pairs(name)
    assert len(rows) >= 250
    for r in rows:
        assert {"first", "second", "relation"} <= set(r) <= {"first", "second", "relation", "zone"}
        assert isinstance(r["first"], str) and isinstance(r["second"], str)
        assert r["first"].strip() and r["second"].strip()
        assert r["first"] != r["second"] or r["relation"] != "duplicate"
        assert r["relation"] in RELATIONS
        if "zone" in r:
            assert r["zone"] in ZONES
    counts = Counter(r["relation"] for r in rows)
    assert set(counts) == set(RELATIONS)
    assert min(counts.values()) >= 50, counts
    # every zone is covered by every relation that carries a zone label
    for rel in ("duplicate", "paraphrase", "near_miss", "related"):
        zones = {r.get("zone") for r in rows if r["relation"] == rel}
        assert set(ZONES) <= zones, (rel, zones)
    lines = Counter((r["first"], r["second"]) for r in rows)
    assert [p for p, n in lines.items() if n > 1] == []


def test_test_pairs_are_held_out() -> None:
    """No held-out text (test pairs, follow-ups) is in anything used for calibration."""
    calib = {content_key(t) for t in _pair_texts("calibration")}
    calib |= {content_key(r["text"]) for r in load_zones()}
    held_out = _pair_texts("test") + _followup_texts()
    leaked = sorted({t for t in held_out if content_key(t) in calib})
    assert leaked == []


def test_followups_are_valid() -> None:
    rows = load_followups()
    dependent = [r for r in rows if r["self_contained"] is False]
    controls = [r for r in rows if r["self_contained"] is True]
    assert len(dependent) >= 40 and len(controls) >= 20
    assert len(dependent) + len(controls) == len(rows)
    for r in rows:
        assert set(r) == {"context_a", "followup", "context_b", "self_contained"}
        for ctx in (r["context_a"], r["context_b"]):
            assert isinstance(ctx, list) and ctx and all(isinstance(m, str) and m for m in ctx)
        assert content_key(r["context_a"][0]) != content_key(r["context_b"][0])
        assert r["followup"].strip()
    # a context-dependent follow-up is short and elliptical; a control is a full question
    assert max(len(r["followup"].split()) for r in dependent) <= 6
    assert min(len(r["followup"].split()) for r in controls) >= 4


def test_loaders_reject_unknown_names() -> None:
    assert load_pairs("test") == load_pairs("pairs_test.jsonl")
    with pytest.raises(InputError):
        load_pairs("benchmarks")
    with pytest.raises(InputError):
        load_jsonl("missing.jsonl")


def _benchmark_texts() -> list[str]:
    """The shipped AdvBench and XSTest prompts, and the Alpaca seed instructions when the
    development workspace holds them."""
    src = benchmark_sources()
    texts: list[str] = []
    for path in (src.advbench, src.xstest):
        with path.open(encoding="utf-8", newline="") as f:
            texts += [row["prompt"] for row in csv.DictReader(f)]
    if src.alpaca_seed is not None:
        with src.alpaca_seed.open(encoding="utf-8") as f:
            texts += [json.loads(line)["instruction"] for line in f if line.strip()]
    return texts


def test_no_text_comes_from_the_benchmarks() -> None:
    bench = _benchmark_texts()
    assert len(bench) >= 520 + 450
    bench_norm = {_norm(t) for t in bench}
    ours = _all_texts()
    assert sorted({t for t in ours if _norm(t) in bench_norm}) == []

    # nor a lightly edited copy: no run of 8 consecutive words in common
    def grams(t: str) -> set[tuple[str, ...]]:
        w = _norm(t).split()
        return {tuple(w[i : i + 8]) for i in range(len(w) - 7)}

    bench_grams: set[tuple[str, ...]] = set().union(*(grams(t) for t in bench))
    assert sorted({t for t in ours if grams(t) & bench_grams}) == []
