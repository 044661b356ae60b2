"""The safety calibration corpus: harmful and matched benign prompts, by category.

Owns reading ``safety_calibration.jsonl``, ``safety_twins.jsonl``, ``safety_written.jsonl``
and ``safety_public.jsonl`` (all described in ``SAFETY_DATA.md`` here), checking each
row's shape, and joining them into the one corpus the guard is calibrated on
(:func:`load_safety_corpus`): the prompt guard's probe is fitted on the hidden
states of these prompts and its threshold set on them (:mod:`isagi.safety.build`).
Only prompts are stored; no answers. The twins file holds short typed requests,
each harmful row with benign twins a word or two away; the public file holds
rows of CatQA, HarmfulQA and CoCoNot under their licences; the written file holds the
project's third round of rows in the register people type (everyday tasks, look-alikes of the
kinds the XSTest paper describes, short plainly harmful requests).

Nothing here comes from the evaluation sets in ``../shared/benchmarks``;
``tests/test_safety_data.py`` checks that. The file is read on call
(``importlib.resources`` through :func:`isagi.data.load_jsonl`), never at
import time.
"""

from __future__ import annotations

from typing import Any

from isagi.data import load_jsonl
from isagi.errors import InputError

__all__ = [
    "SAFETY_CATEGORIES",
    "SAFETY_FILE",
    "SAFETY_LABELS",
    "SAFETY_SOURCES",
    "ORDINARY_KIND",
    "TWINS_FILE",
    "PUBLIC_FILE",
    "is_ordinary",
    "load_safety_corpus",
    "load_safety_public",
    "load_safety_calibration",
    "load_safety_twins",
    "load_safety_written",
    "WRITTEN_FILE",
]

SAFETY_FILE = "safety_calibration.jsonl"
TWINS_FILE = "safety_twins.jsonl"
WRITTEN_FILE = "safety_written.jsonl"
# the kinds a written row may have: the harmful rows' forms, the benign look-alikes' kinds (the
# calibration file's) and everyday tasks
WRITTEN_KINDS: tuple[str, ...] = ("question", "short", "homonym", "figurative", "safe_target", "safe_context",
                                  "definition", "history", "public_figure", "discrimination_fact",
                                  "ordinary_task")
SAFETY_CATEGORIES: tuple[str, ...] = (
    "privacy",
    "illegal_advice",
    "phishing",
    "sycophancy",
    "jailbreak",
    "toxicity",
    "misinformation",
    "self_harm",
)
SAFETY_LABELS: tuple[str, ...] = ("harmful", "benign")
SAFETY_SOURCES: tuple[str, ...] = ("harmbench", "isagi", "catqa", "harmfulqa", "coconot")
PUBLIC_FILE = "safety_public.jsonl"
# The public rows' kinds (scripts/import_public_safety.py): harmful, benign look-alikes (CoCoNot's
# contrast set: answerable requests that look like safety cases), ordinary benign requests.
PUBLIC_KINDS: tuple[str, ...] = ("public_harmful", "public_lookalike", "public_ordinary")
# Benign rows of this kind are everyday instruction tasks, not borderline look-alikes: the guard
# learns from them that an imperative task ("Write a ...") is not the harm, and the prompt
# threshold's FPR budget is stated over the other benign rows (isagi.safety.calibration.FPR_BUDGET).
ORDINARY_KIND = "ordinary_task"

_ALLOWED = {
    "label": SAFETY_LABELS,
    "category": SAFETY_CATEGORIES,
    "source": SAFETY_SOURCES,
}


def load_safety_calibration() -> list[dict[str, Any]]:
    """Safety calibration prompts, in file order.

    Each row is ``{"text": str, "label": "harmful" | "benign",
    "category": one of SAFETY_CATEGORIES, "source": "harmbench" | "isagi"}``.
    Raises :class:`~isagi.errors.InputError` naming the line when a row is
    malformed, so a damaged install never calibrates on half a corpus.
    """
    return _checked(SAFETY_FILE, load_jsonl(SAFETY_FILE))


def load_safety_twins() -> list[dict[str, Any]]:
    """Short typed requests and their benign twins, in file order.

    Each row has the calibration fields (``text``, ``label``, ``category``,
    ``source``) plus ``pair``, the id shared by one harmful request and the
    benign twins that differ from it by a word or two, and ``kind``, a sub-kind
    tag (``"explosives"``, ``"homonym"``, ...). Raises
    :class:`~isagi.errors.InputError` naming the row when a row is malformed.
    """
    rows = _checked(TWINS_FILE, load_jsonl(TWINS_FILE))
    for lineno, row in enumerate(rows, start=1):
        for key in ("pair", "kind"):
            value = row.get(key)
            if not isinstance(value, str) or not value.strip():
                raise InputError(f"{TWINS_FILE} row {lineno} has no {key}; reinstall ISAGI.")
    return rows


def load_safety_written() -> list[dict[str, Any]]:
    """The project's third round of rows (``safety_written.jsonl``, SAFETY_DATA.md "Round 6"): each
    has the calibration fields plus ``kind`` (:data:`WRITTEN_KINDS`); harmful rows are ``question``
    or ``short``. Raises :class:`~isagi.errors.InputError` naming a malformed row."""
    rows = _checked(WRITTEN_FILE, load_jsonl(WRITTEN_FILE))
    for lineno, row in enumerate(rows, start=1):
        harmful_form = row.get("kind") in ("question", "short")
        if (row.get("kind") not in WRITTEN_KINDS or row.get("source") != "isagi"
                or harmful_form != (row.get("label") == "harmful")):
            raise InputError(f"{WRITTEN_FILE} row {lineno} has kind={row.get('kind')!r}, label="
                             f"{row.get('label')!r}, source={row.get('source')!r}; reinstall ISAGI.")
    return rows


def load_safety_public() -> list[dict[str, Any]]:
    """The public corpora's rows (CatQA, HarmfulQA, CoCoNot), mapped to the project's categories.

    Each row has the calibration fields plus ``kind`` (one of :data:`PUBLIC_KINDS`) and
    ``origin``, the source's own category. Raises :class:`~isagi.errors.InputError` naming the
    row when a row is malformed.
    """
    rows = _checked(PUBLIC_FILE, load_jsonl(PUBLIC_FILE))
    for lineno, row in enumerate(rows, start=1):
        if row.get("kind") not in PUBLIC_KINDS or row.get("source") in ("harmbench", "isagi"):
            raise InputError(f"{PUBLIC_FILE} row {lineno} has kind={row.get('kind')!r}, source="
                             f"{row.get('source')!r}; reinstall ISAGI.")
    return rows


def load_safety_corpus() -> list[dict[str, Any]]:
    """Every row the prompt guard is calibrated on: the project's calibration rows, the twins, the
    written rows and the public rows, in that order, each with three more fields the fit reads:

    - ``group``: rows that must stay in one fold (a twin pair, copies of one text; otherwise the
      row alone);
    - ``benign_kind``: ``"ordinary"`` (an everyday, incomplete or unsupported request),
      ``"lookalike"`` (a benign request that resembles harm) or ``None`` for a harmful row;
    - ``origin``: the source the row comes from for leave-one-source-out cross-validation
      (``project``, ``harmbench``, ``twins``, ``catqa``, ``harmfulqa``, ``coconot``, ``everyday``).
    """
    out: list[dict[str, Any]] = []
    first_group: dict[str, str] = {}
    for part, rows in (("calibration", load_safety_calibration()), ("twins", load_safety_twins()),
                       ("written", load_safety_written()), ("public", load_safety_public()),
                       ("everyday", everyday_requests())):
        for i, row in enumerate(rows):
            if row["label"] == "harmful":
                kind = None
            elif is_ordinary(row) or row.get("kind") in ("public_ordinary", "everyday"):
                kind = "ordinary"
            else:
                kind = "lookalike"
            if part == "twins":
                group, origin = f"pair:{row['pair']}", "twins"
            elif part == "everyday":
                group, origin = f"{part}:{i}", "everyday"
            else:
                group = f"{part}:{i}"
                origin = {"isagi": "project"}.get(row["source"], row["source"])
            # a text that occurs twice (a few do, within a public corpus or across files) is one
            # group, so a fold never trains on the copy of a row it tests
            group = first_group.setdefault(" ".join(row["text"].lower().split()), group)
            out.append({**row, "group": group, "benign_kind": kind, "source_group": origin})
    return out


def everyday_requests() -> list[dict[str, Any]]:
    """The project's ordinary chat requests as benign calibration rows: the zone prompts and the
    questions of the calibration pairs (``zones.jsonl``, ``pairs_calibration.jsonl``; never the
    held-out pairs), each text once, with ``kind`` ``everyday`` and the categories in turn (a
    benign row needs one for the category folds). Nothing in them resembles harm: they state
    what ordinary use looks like, beside the public corpora's incomplete and unsupported requests."""
    from isagi.data import load_pairs, load_zones

    texts = [r["text"] for r in load_zones()]
    texts += [t for p in load_pairs("calibration") for t in (p["first"], p["second"])]
    seen: set[str] = set()
    rows: list[dict[str, str]] = []
    for text in texts:
        key = " ".join(text.lower().split())
        if key in seen:
            continue
        seen.add(key)
        rows.append({"text": text, "label": "benign", "category": SAFETY_CATEGORIES[len(rows) % len(SAFETY_CATEGORIES)],
                     "source": "isagi", "kind": "everyday"})
    return rows


def _checked(filename: str, rows: list[dict[str, Any]]) -> list[dict[str, Any]]:
    """``rows`` unchanged when every one has prompt text and allowed label, category and source."""
    for lineno, row in enumerate(rows, start=1):
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{filename} row {lineno} has no prompt text; reinstall ISAGI.")
        for key, allowed in _ALLOWED.items():
            if row.get(key) not in allowed:
                raise InputError(
                    f"{filename} row {lineno} has {key}={row.get(key)!r}; "
                    f"expected one of: {', '.join(allowed)}. Reinstall ISAGI."
                )
    return rows


def is_ordinary(row: dict[str, Any]) -> bool:
    """Whether a calibration row is an everyday instruction task (benign, outside the FPR budget)."""
    return row.get("kind") == ORDINARY_KIND
