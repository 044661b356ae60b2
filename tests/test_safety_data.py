"""The safety calibration corpus and the twins file: valid, balanced, unique, and not the evaluation sets.

The TEH guard's forbidden subspace and threshold are fitted on the calibration
file, and its out-of-sample claims rest on these checks: every AdvBench /
XSTest / Alpaca figure is only honest if no row here is one of those prompts or
a light edit of one. The twins file (issue 22) is held to the same overlap rule
before anything is fitted on it, and to what it says it is: one harmful request
per pair with benign twins a small edit away.
"""

from __future__ import annotations

import csv
import json
import re
from collections import Counter
from importlib import resources
from pathlib import Path

import pytest

from isagi.data import safety
from isagi.data.safety import (
    ORDINARY_KIND,
    SAFETY_CATEGORIES,
    SAFETY_FILE,
    SAFETY_LABELS,
    SAFETY_SOURCES,
    TWINS_FILE,
    is_ordinary,
    load_safety_calibration,
    load_safety_corpus,
    load_safety_public,
    load_safety_twins,
    load_safety_written,
)
from isagi.errors import InputError
from isagi.evals.sets import benchmark_sources

SHARED = Path(__file__).resolve().parents[2] / "shared"
HARMBENCH = SHARED / "calibration" / "harmbench_standard_behaviors.csv"
MIN_PER_CELL = 50
JACCARD_LIMIT = 0.5  # issue 13: no calibration row may reach a token Jaccard above 0.5 to an evaluation prompt
PROMPT_FIELDS = ("prompt", "instruction", "text")


def _raw_lines(filename: str = SAFETY_FILE) -> list[str]:
    text = resources.files("isagi.data").joinpath(filename).read_text(encoding="utf-8")
    return text.splitlines()


def _norm(text: str) -> str:
    """Lower case, letters and digits only (the exact-copy key)."""
    return re.sub(r"[^a-z0-9]", "", text.lower())


def _tokens(text: str) -> frozenset[str]:
    return frozenset(re.findall(r"[a-z0-9]+", text.lower()))


def _jaccard(a: frozenset[str], b: frozenset[str]) -> float:
    return len(a & b) / len(a | b) if a | b else 1.0


def _prompt_of(row: dict) -> str | None:
    for field in PROMPT_FIELDS:
        value = row.get(field)
        if isinstance(value, str) and value.strip():
            return value
    return None


def _benchmark_prompts() -> tuple[list[str], int]:
    """Every prompt of the evaluation sets, and how many sets were read: the shipped AdvBench
    and XSTest always, the Alpaca seed tasks when the development workspace holds them."""
    src = benchmark_sources()
    prompts: list[str] = []
    for path in (src.advbench, src.xstest):
        with path.open(encoding="utf-8", newline="") as f:
            prompts += [p for row in csv.DictReader(f) if (p := _prompt_of(row))]
    if src.alpaca_seed is not None:
        with src.alpaca_seed.open(encoding="utf-8") as f:
            prompts += [p for line in f if line.strip() if (p := _prompt_of(json.loads(line)))]
    return prompts, 2 + (src.alpaca_seed is not None)


def test_every_line_is_a_json_object_with_the_schema() -> None:
    lines = _raw_lines()
    assert len(lines) >= MIN_PER_CELL * 2 * len(SAFETY_CATEGORIES)
    for lineno, line in enumerate(lines, start=1):
        assert line.strip(), f"blank line {lineno}"
        row = json.loads(line)
        assert isinstance(row, dict), lineno
        assert set(row) - {"kind"} == {"text", "label", "category", "source"}, lineno
        assert row.get("kind", "question") in ROW_KINDS, lineno
        assert isinstance(row["text"], str) and row["text"] == row["text"].strip(), lineno
        assert 3 <= len(row["text"].split()) <= 60, f"line {lineno} is not a short prompt"
        assert row["label"] in SAFETY_LABELS, lineno
        assert row["category"] in SAFETY_CATEGORIES, lineno
        assert row["source"] in SAFETY_SOURCES, lineno


def test_loader_returns_the_file_rows_in_order() -> None:
    rows = load_safety_calibration()
    assert rows == [json.loads(line) for line in _raw_lines()]
    assert rows is not load_safety_calibration()  # a fresh list each call


def test_every_category_has_enough_harmful_and_benign_rows() -> None:
    counts = Counter((r["category"], r["label"]) for r in load_safety_calibration())
    short = {
        (c, lab): counts[(c, lab)]
        for c in SAFETY_CATEGORIES
        for lab in SAFETY_LABELS
        if counts[(c, lab)] < MIN_PER_CELL
    }
    assert short == {}


def test_benign_rows_are_the_projects_own() -> None:
    rows = load_safety_calibration()
    assert {r["source"] for r in rows if r["label"] == "benign"} == {"isagi"}
    # benign rows include everyday requests, not only alarming look-alikes
    benign = [r["text"].lower() for r in rows if r["label"] == "benign"]
    assert any("python" in t for t in benign)
    assert any("recipe" in t or "bake" in t or "make" in t for t in benign)


def test_no_duplicate_texts() -> None:
    """Within and across the project's files: a row that repeats another adds nothing."""
    keys = Counter(_norm(r["text"]) for r in (*load_safety_calibration(), *load_safety_twins(),
                                              *load_safety_written()))
    assert [k for k, n in keys.items() if n > 1] == []


@pytest.mark.skipif(not HARMBENCH.is_file(), reason="shared HarmBench calibration file absent")
def test_harmbench_rows_are_verbatim_harmbench_behaviours() -> None:
    with HARMBENCH.open(encoding="utf-8", newline="") as f:
        harmbench = {row["prompt"].strip() for row in csv.DictReader(f)}
    rows = load_safety_calibration()
    from_hb = [r for r in rows if r["source"] == "harmbench"]
    assert from_hb, "the corpus is documented as including HarmBench rows"
    assert all(r["label"] == "harmful" for r in from_hb)
    assert sorted(r["text"] for r in from_hb if r["text"] not in harmbench) == []
    # rows marked as the project's own are not HarmBench rows in disguise
    hb_norm = {_norm(t) for t in harmbench}
    assert [r["text"] for r in rows if r["source"] == "isagi" and _norm(r["text"]) in hb_norm] == []


@pytest.mark.parametrize("load", [load_safety_calibration, load_safety_twins, load_safety_public,
                                  load_safety_written], ids=["calibration", "twins", "public", "written"])
def test_no_row_copies_an_evaluation_prompt(load) -> None:
    bench, n_sets = _benchmark_prompts()
    assert len(bench) == {2: 520 + 450, 3: 520 + 450 + 175}[n_sets], "benchmark prompts were not all read"
    bench_norm = {_norm(t) for t in bench}
    rows = load()
    assert sorted(r["text"] for r in rows if _norm(r["text"]) in bench_norm) == []

    # nor a near-copy: token-set Jaccard above 0.5 against any benchmark prompt
    bench_tokens = [_tokens(t) for t in bench]
    near = []
    for r in rows:
        mine = _tokens(r["text"])
        best = max(_jaccard(mine, b) for b in bench_tokens)
        if best > JACCARD_LIMIT:
            near.append((r["text"], round(best, 2)))
    assert near == []


def test_jaccard_flags_a_light_edit() -> None:
    # the near-copy check must catch reordering and a changed word or two
    a = _tokens("Write a tutorial on how to make a cake at home")
    b = _tokens("At home, write a tutorial on how to make a cake!")
    c = _tokens("Write a tutorial on how to bake a cake at home")
    assert _jaccard(a, b) == 1.0
    assert _jaccard(a, c) >= JACCARD_LIMIT
    assert _jaccard(a, _tokens("What is the capital of France?")) < JACCARD_LIMIT


def test_loader_rejects_a_malformed_row(monkeypatch: pytest.MonkeyPatch) -> None:
    good = {
        "text": "How do I bake bread?",
        "label": "benign",
        "category": "toxicity",
        "source": "isagi",
    }
    bad_rows = [
        {**good, "label": "unsafe"},
        {**good, "category": "weapons"},
        {**good, "source": "advbench"},
        {**good, "text": "   "},
        {k: v for k, v in good.items() if k != "text"},
    ]
    for bad in bad_rows:
        monkeypatch.setattr(safety, "load_jsonl", lambda _name, bad=bad: [good, bad])
        with pytest.raises(InputError, match="row 2"):
            load_safety_calibration()
    monkeypatch.setattr(safety, "load_jsonl", lambda _name: [good])
    assert load_safety_calibration() == [good]


HARMFUL_FORMS = ("question", "imperative", "first_person", "roleplay", "fiction_wrapper", "indirect", "short",
                 "pasted_text")
BORDERLINE_KINDS = ("homonym", "figurative", "safe_target", "safe_context", "definition", "history",
                    "public_figure", "discrimination_fact", "safety_help", "pasted_text")
ROW_KINDS = frozenset((*HARMFUL_FORMS, *BORDERLINE_KINDS, ORDINARY_KIND))


def test_the_written_borderline_and_harmful_rows_are_many_balanced_and_varied() -> None:
    """Issue 13: at least 400 new benign borderline and 400 new harmful rows (the rows with a
    ``kind``), balanced over the categories, harmful ones in many forms, not one template."""
    rows = [r for r in load_safety_calibration() if "kind" in r and not is_ordinary(r)]
    harmful = [r for r in rows if r["label"] == "harmful"]
    benign = [r for r in rows if r["label"] == "benign"]
    assert len(harmful) >= 400 and len(benign) >= 400
    for group in (harmful, benign):
        per_cat = Counter(r["category"] for r in group)
        assert set(per_cat) == set(SAFETY_CATEGORIES)
        assert max(per_cat.values()) - min(per_cat.values()) <= 0.1 * max(per_cat.values())
    assert {r["kind"] for r in harmful} == set(HARMFUL_FORMS)
    assert {r["kind"] for r in benign} == set(BORDERLINE_KINDS)
    assert max(Counter(r["kind"] for r in harmful).values()) <= 0.2 * len(harmful)
    # not AdvBench's "Write a script that ..." form only
    assert sum(r["text"].lower().startswith(("write a", "create a", "develop a")) for r in harmful) < 0.2 * len(harmful)


def test_the_everyday_tasks_are_benign_balanced_and_not_one_opening() -> None:
    """The ordinary instruction tasks teach the guard that the imperative form is not the harm:
    they must be benign, spread over the categories and open with many verbs, not one template."""
    rows = [r for r in load_safety_calibration() if is_ordinary(r)]
    assert len(rows) >= 200
    assert {r["label"] for r in rows} == {"benign"} and {r["source"] for r in rows} == {"isagi"}
    per_cat = Counter(r["category"] for r in rows)
    assert set(per_cat) == set(SAFETY_CATEGORIES) and max(per_cat.values()) == min(per_cat.values())
    openers = Counter(r["text"].split()[0].lower() for r in rows)
    assert len(openers) >= 30 and max(openers.values()) <= 0.15 * len(rows)
    assert sum("\n" in r["text"] for r in rows) >= 0.2 * len(rows)  # some carry an input, as tasks do


# --- the twins file (issue 22): short typed requests, each with benign twins a word or two away ---

TWIN_FIELDS = {"text", "label", "category", "source", "pair", "kind"}
MIN_TWINS_PER_CELL = 40
# A benign twin keeps most of its harmful row's words: token Jaccard at least this (a one-word swap in a
# ten-word request is about 0.8; a changed object plus a changed purpose clause still clears 0.3).
TWIN_JACCARD_MIN = 0.3
ILLEGAL_SUBKINDS = ("explosives", "weapons", "drugs", "poison", "malware", "violence", "theft", "fraud", "chembio")
HELD_OUT_OBJECTS = ("pipe bomb", "birdhouse")  # the issue's own checks; no row may train on them


def _pairs() -> dict[str, list[dict]]:
    pairs: dict[str, list[dict]] = {}
    for r in load_safety_twins():
        pairs.setdefault(r["pair"], []).append(r)
    return pairs


def test_twins_every_line_has_the_schema_and_the_typed_register() -> None:
    lines = _raw_lines(TWINS_FILE)
    assert load_safety_twins() == [json.loads(line) for line in lines]
    for lineno, line in enumerate(lines, start=1):
        row = json.loads(line)
        assert set(row) == TWIN_FIELDS, lineno
        assert row["label"] in SAFETY_LABELS and row["category"] in SAFETY_CATEGORIES, lineno
        assert row["source"] == "isagi", lineno  # all written for the project
        assert row["text"] == row["text"].strip() and "\n" not in row["text"], lineno
        assert 4 <= len(row["text"].split()) <= 20, f"line {lineno} is not a short typed request"
        assert re.fullmatch(r"[a-z_]+", row["kind"]) and row["pair"].startswith(row["category"] + "-"), lineno


def test_twins_every_pair_is_one_harmful_request_and_its_benign_twins() -> None:
    for pair, rows in _pairs().items():
        labels = Counter(r["label"] for r in rows)
        assert labels["harmful"] == 1 and labels["benign"] >= 1, pair
        assert rows[0]["label"] == "harmful", pair  # the request first, then its twins
        assert len({r["category"] for r in rows}) == 1, pair


def test_twins_cover_every_category_and_every_kind_of_illegal_advice() -> None:
    rows = load_safety_twins()
    cells = Counter((r["category"], r["label"]) for r in rows)
    short = {cell: cells[cell] for cell in ((c, lab) for c in SAFETY_CATEGORIES for lab in SAFETY_LABELS)
             if cells[cell] < MIN_TWINS_PER_CELL}
    assert short == {}
    n_harmful = sum(r["label"] == "harmful" for r in rows)
    assert n_harmful >= 400 and len(rows) - n_harmful >= n_harmful
    illegal = Counter(r["kind"] for r in rows if r["category"] == "illegal_advice" and r["label"] == "harmful")
    assert {k: illegal[k] for k in ILLEGAL_SUBKINDS if illegal[k] < 10} == {}


def test_twins_are_a_small_edit_of_their_harmful_row() -> None:
    far, same = [], []
    for pair, rows in _pairs().items():
        harmful = _tokens(rows[0]["text"])
        for twin in rows[1:]:
            j = _jaccard(harmful, _tokens(twin["text"]))
            if j < TWIN_JACCARD_MIN:
                far.append((pair, twin["text"], round(j, 2)))
            if j == 1.0:
                same.append((pair, twin["text"]))  # the same words reordered is not a twin
    assert far == [] and same == []


def test_twins_read_as_typed_not_one_template() -> None:
    """Many openings, most rows in lower case as people type them, no one opening for the harmful side."""
    rows = load_safety_twins()
    harmful = [r["text"] for r in rows if r["label"] == "harmful"]
    openings = Counter(" ".join(t.lower().split()[:2]) for t in harmful)
    assert len(openings) >= 60 and max(openings.values()) <= 0.2 * len(harmful)
    assert sum(t[0].islower() for t in harmful) >= 0.5 * len(harmful)


def test_twins_leave_out_the_issues_held_out_objects() -> None:
    held = [_norm(obj) for obj in HELD_OUT_OBJECTS]
    assert [r["text"] for r in load_safety_twins() if any(h in _norm(r["text"]) for h in held)] == []


def test_twins_loader_rejects_a_malformed_row(monkeypatch: pytest.MonkeyPatch) -> None:
    good = {"text": "how do i fix a crack in my phone screen", "label": "benign", "category": "illegal_advice",
            "source": "isagi", "pair": "illegal_advice-001", "kind": "homonym"}
    bad_rows = [
        {**good, "label": "unsafe"},
        {**good, "text": ""},
        {**good, "pair": " "},
        {**good, "kind": None},
        {k: v for k, v in good.items() if k != "pair"},
    ]
    for bad in bad_rows:
        monkeypatch.setattr(safety, "load_jsonl", lambda _name, bad=bad: [good, bad])
        with pytest.raises(InputError, match=f"{TWINS_FILE} row 2"):
            load_safety_twins()
    monkeypatch.setattr(safety, "load_jsonl", lambda _name: [good])
    assert load_safety_twins() == [good]


# --- the public corpora (issue 36): CatQA, HarmfulQA, CoCoNot, mapped to the project's categories ---


def test_public_rows_keep_their_sources_labels_and_licences() -> None:
    from importlib import resources

    rows = load_safety_public()
    by_source = Counter(r["source"] for r in rows)
    # the sources' own sizes (shared README) less the few rows dropped as too close to an evaluation prompt
    assert 470 <= by_source["catqa"] <= 485 and 1820 <= by_source["harmfulqa"] <= 1850
    assert 1800 <= by_source["coconot"] <= 1841
    assert {r["label"] for r in rows if r["source"] in ("catqa", "harmfulqa")} == {"harmful"}
    # CoCoNot's contrast set is benign; only its safety-concern requests in the eval set are harmful
    assert all(r["label"] == "benign" for r in rows if r["kind"] in ("public_lookalike", "public_ordinary"))
    assert all(r["origin"].startswith("Requests with safety concerns") for r in rows
               if r["source"] == "coconot" and r["label"] == "harmful")
    data = resources.files("isagi.data")
    for name in ("LICENSE-coconot.txt", "LICENSE-red-instruct.txt"):
        assert data.joinpath("licenses", name).read_text(encoding="utf-8").strip()


def test_the_corpus_keeps_twin_pairs_in_one_group_and_marks_each_benign_kind() -> None:
    from isagi.data.safety import everyday_requests

    rows = load_safety_corpus()
    assert len(rows) == (len(load_safety_calibration()) + len(load_safety_twins()) + len(load_safety_written())
                         + len(load_safety_public()) + len(everyday_requests()))
    # copies of one text are one group: no fold trains on the copy of a row it tests
    group_of_text: dict[str, set[str]] = {}
    for r in rows:
        group_of_text.setdefault(" ".join(r["text"].lower().split()), set()).add(r["group"])
    assert all(len(g) == 1 for g in group_of_text.values())
    # the everyday requests are the zone prompts and the calibration pairs' questions, never the held-out pairs
    from isagi.data import load_pairs

    held_out = {t for p in load_pairs("test") for t in (p["first"], p["second"])}
    everyday = {r["text"] for r in everyday_requests()}
    assert everyday and not everyday & held_out
    pairs = _pairs()
    group_of = {r["text"]: r["group"] for r in rows if r["source_group"] == "twins"}
    for members in pairs.values():
        assert len({group_of[m["text"]] for m in members}) == 1
    assert {r["benign_kind"] for r in rows if r["label"] == "harmful"} == {None}
    kinds = Counter(r["benign_kind"] for r in rows if r["label"] == "benign")
    assert kinds["ordinary"] > 1000 and kinds["lookalike"] > 2000
    assert all(r["benign_kind"] == "ordinary" for r in rows if r.get("kind") == "ordinary_task")


# --- the written rows (round 6): the register people type ---


def test_written_rows_have_the_schema_and_keep_out_the_issues_held_out_objects() -> None:
    rows = load_safety_written()
    assert len(rows) >= 1000
    for row in rows:
        assert set(row) == {"text", "label", "category", "source", "kind"}
        assert row["source"] == "isagi" and row["category"] in SAFETY_CATEGORIES
        assert 3 <= len(row["text"].split()) <= 60 and row["text"] == row["text"].strip()
        assert not any(obj in row["text"].lower() for obj in HELD_OUT_OBJECTS), row["text"]


def test_written_rows_cover_the_kinds_and_read_as_typed_not_one_template() -> None:
    """Everyday tasks, look-alikes of each kind the XSTest paper describes, short harmful requests;
    many openings, none dominant; some with a pasted input, some typed in lower case."""
    rows = load_safety_written()
    kinds = Counter(r["kind"] for r in rows)
    assert kinds[ORDINARY_KIND] >= 400 and sum(kinds[k] for k in ("question", "short")) >= 150
    lookalike = {"homonym", "figurative", "safe_target", "safe_context", "definition", "history",
                 "public_figure", "discrimination_fact"}
    assert all(kinds[k] >= 30 for k in lookalike)
    for group in ([r for r in rows if r["kind"] == ORDINARY_KIND], [r for r in rows if r["kind"] in lookalike],
                  [r for r in rows if r["label"] == "harmful"]):
        openers = Counter(r["text"].split()[0].lower() for r in group)
        assert len(openers) >= 25 and max(openers.values()) <= 0.3 * len(group)
    assert sum("\n" in r["text"] for r in rows if r["kind"] == ORDINARY_KIND) >= 0.2 * kinds[ORDINARY_KIND]
    assert sum(r["text"][0].islower() for r in rows) >= 0.1 * len(rows)


def test_the_corpus_takes_the_written_rows_as_the_projects_own() -> None:
    written = {r["text"] for r in load_safety_written()}
    corpus = [r for r in load_safety_corpus() if r["text"] in written]
    assert len(corpus) == len(written)
    assert {r["source_group"] for r in corpus} == {"project"}
    assert {r["benign_kind"] for r in corpus if r["kind"] == ORDINARY_KIND} == {"ordinary"}
    assert {r["benign_kind"] for r in corpus if r["label"] == "benign" and r["kind"] != ORDINARY_KIND} == {"lookalike"}
