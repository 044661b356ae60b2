"""The safety calibration corpus: harmful and matched benign prompts, by category.

Owns reading ``safety_calibration.jsonl`` and ``safety_twins.jsonl`` (both
described in ``SAFETY_DATA.md`` here) and checking each row's shape. The geometric guard (Snipe, TEH) is
calibrated on the hidden states of these prompts: per-category directions
that separate ``harmful`` from ``benign`` rows, and the TEH threshold from an
ROC sweep over them. Only prompts are stored; no answers. The twins file
(short typed requests, each harmful row with benign twins a word or two away)
is not read by the profile build yet; fitting on it changes the shipped profiles.

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
    "is_ordinary",
    "load_safety_calibration",
    "load_safety_twins",
]

SAFETY_FILE = "safety_calibration.jsonl"
TWINS_FILE = "safety_twins.jsonl"
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
SAFETY_SOURCES: tuple[str, ...] = ("harmbench", "isagi")
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
