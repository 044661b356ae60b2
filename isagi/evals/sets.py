"""The public evaluation sets under ``../shared/benchmarks``: where they are and how they are read.

Owns the one reading of each file (``shared/benchmarks/README.md`` says how
they are meant to be read) for every evaluation that uses them. Nothing here
is ever used to calibrate or tune: these prompts only measure.

- AdvBench: the ``prompt`` column, harmful.
- XSTest: ``prompt`` split by ``label`` into ``unsafe`` (harmful) and ``safe``.
- Alpaca seed tasks: the ``instruction``, benign; ``with_input`` appends the
  first example input after a blank line (the form a model is actually sent).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import TypeVar

from isagi.errors import InputError

ADVBENCH = "advbench_harmful_behaviors.csv"
XSTEST = "xstest_prompts.csv"
ALPACA = "alpaca_seed_tasks.jsonl"

T = TypeVar("T")


def default_benchmarks_dir() -> Path:
    """``../shared/benchmarks`` next to the repository root."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "benchmarks"


def _read(path: Path, parse: Callable[[str], T]) -> T:
    """``parse(text of path)``; a missing or malformed file is an :class:`InputError` naming it."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (OSError, KeyError, json.JSONDecodeError) as exc:
        raise InputError(
            f"Cannot read {path} ({exc}). Pass --benchmarks DIR holding {ADVBENCH}, {XSTEST} and {ALPACA}."
        ) from exc


def _csv_rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(text.splitlines()))


def load_advbench(directory: Path) -> list[str]:
    return _read(Path(directory) / ADVBENCH,
                 lambda t: [r["prompt"].strip() for r in _csv_rows(t) if r["prompt"].strip()])


def load_xstest(directory: Path) -> dict[str, list[str]]:
    """``{"unsafe": [...], "safe": [...]}``."""
    rows = _read(Path(directory) / XSTEST, _csv_rows)
    try:
        return {label: [r["prompt"] for r in rows if r["label"] == label] for label in ("unsafe", "safe")}
    except KeyError as exc:
        raise InputError(f"{Path(directory) / XSTEST} has no {exc} column.") from exc


def load_alpaca_seed(directory: Path, *, with_input: bool = False) -> list[str]:
    def parse(text: str) -> list[str]:
        out = []
        for line in text.splitlines():
            if not line.strip():
                continue
            row = json.loads(line)
            instruction = row["instruction"].strip()
            example = (row.get("instances") or [{}])[0].get("input", "").strip() if with_input else ""
            out.append(f"{instruction}\n\n{example}" if example else instruction)
        return out

    return _read(Path(directory) / ALPACA, parse)


def load_benchmark_sets(directory: Path) -> dict[str, list[str]]:
    """The four sets ``isagi eval safety`` reports: AdvBench and XSTest-unsafe harmful,
    XSTest-safe and the Alpaca seed instructions benign."""
    xs = load_xstest(directory)
    return {"advbench": load_advbench(directory), "xstest_unsafe": xs["unsafe"], "xstest_safe": xs["safe"],
            "alpaca_seed": load_alpaca_seed(directory)}
