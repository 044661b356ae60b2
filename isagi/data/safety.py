"""The safety calibration corpus: harmful and matched benign prompts, by category.

Owns reading ``safety_calibration.jsonl`` (described in ``SAFETY_DATA.md``
here) and checking each row's shape. The geometric guard (Snipe, TEH) is
calibrated on the hidden states of these prompts: per-category directions
that separate ``harmful`` from ``benign`` rows, and the TEH threshold from an
ROC sweep over them. Only prompts are stored; no answers.

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
    "is_ordinary",
    "load_safety_calibration",
]

SAFETY_FILE = "safety_calibration.jsonl"
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
# threshold's FPR budget is stated over the other benign rows (isagi.safety.FPR_BUDGET).
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
    rows = load_jsonl(SAFETY_FILE)
    for lineno, row in enumerate(rows, start=1):
        text = row.get("text")
        if not isinstance(text, str) or not text.strip():
            raise InputError(f"{SAFETY_FILE} row {lineno} has no prompt text; reinstall ISAGI.")
        for key, allowed in _ALLOWED.items():
            if row.get(key) not in allowed:
                raise InputError(
                    f"{SAFETY_FILE} row {lineno} has {key}={row.get(key)!r}; "
                    f"expected one of: {', '.join(allowed)}. Reinstall ISAGI."
                )
    return rows


def is_ordinary(row: dict[str, Any]) -> bool:
    """Whether a calibration row is an everyday instruction task (benign, outside the FPR budget)."""
    return row.get("kind") == ORDINARY_KIND
