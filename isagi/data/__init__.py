"""The project's own calibration and held-out data files, and their loaders.

Owns reading the JSONL files shipped in this package (see README.md here):

- ``zones.jsonl``: prompts labelled with a knowledge zone (UGT basis and
  zone centroids are calibrated on these).
- ``pairs_calibration.jsonl``: labelled query pairs for calibrating the
  distance scale and tiers.
- ``pairs_test.jsonl``: held-out pairs for checking generalisation; never
  used for calibration.
- ``followups.jsonl``: context-dependent follow-ups (and self-contained
  controls) for checking that a follow-up is never answered from another
  context's memory.

Files are read on call (``importlib.resources``), never at import time.
"""

from __future__ import annotations

import json
from importlib import resources
from typing import Any

from isagi.errors import InputError

__all__ = [
    "PAIR_FILES",
    "RELATIONS",
    "ZONES",
    "load_followups",
    "load_jsonl",
    "load_pairs",
    "load_zones",
]

ZONES: tuple[str, ...] = ("factual", "math", "code", "creative", "science", "advice")
RELATIONS: tuple[str, ...] = ("duplicate", "paraphrase", "near_miss", "related", "unrelated")
PAIR_FILES: dict[str, str] = {
    "calibration": "pairs_calibration.jsonl",
    "test": "pairs_test.jsonl",
}


def load_jsonl(filename: str) -> list[dict[str, Any]]:
    """Read one JSONL file shipped in ``isagi.data``; one dict per non-empty line."""
    path = resources.files(__name__).joinpath(filename)
    if not path.is_file():
        raise InputError(
            f"Data file {filename!r} is not in the isagi.data package; "
            "reinstall ISAGI or check the file name."
        )
    rows: list[dict[str, Any]] = []
    text = path.read_text(encoding="utf-8")
    for lineno, line in enumerate(text.splitlines(), start=1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
        except json.JSONDecodeError as exc:
            raise InputError(f"{filename} line {lineno} is not valid JSON: {exc.msg}.") from exc
        if not isinstance(row, dict):
            raise InputError(f"{filename} line {lineno} is not a JSON object.")
        rows.append(row)
    return rows


def load_zones() -> list[dict[str, Any]]:
    """Zone-labelled calibration prompts: ``[{"text": str, "zone": str}, ...]``."""
    return load_jsonl("zones.jsonl")


def load_pairs(name: str) -> list[dict[str, Any]]:
    """Labelled query pairs: ``[{"first", "second", "relation", ...}, ...]``.

    ``name`` is ``"calibration"`` or ``"test"`` (the held-out set); the file
    names ``"pairs_calibration"`` / ``"pairs_test.jsonl"`` are accepted too.
    """
    key = name.removesuffix(".jsonl").removeprefix("pairs_")
    if key not in PAIR_FILES:
        raise InputError(f"Unknown pair set {name!r}; use one of: {', '.join(sorted(PAIR_FILES))}.")
    return load_jsonl(PAIR_FILES[key])


def load_followups() -> list[dict[str, Any]]:
    """Follow-up probes: ``{"context_a": [str], "followup": str, "context_b": [str],
    "self_contained": bool}``."""
    return load_jsonl("followups.jsonl")
