"""The public evaluation sets: where each one is read from, and how it is read.

Owns the one decision of where each set comes from (:func:`benchmark_sources`)
and the one reading of each file (``benchmarks/README.md`` beside this module
says what the files are and how they are meant to be read) for every
evaluation that uses them. Nothing here is ever used to calibrate or tune:
these prompts only measure.

Where each set comes from:

- ``--benchmarks DIR`` given: every set from DIR. AdvBench and XSTest must be
  there; the Alpaca seed tasks are measured when their file is there.
- otherwise AdvBench and XSTest from the copies that ship with the package
  (:data:`SHIPPED_DIR`, MIT and CC BY 4.0), and the Alpaca seed tasks from the
  development workspace's ``../shared/benchmarks`` when it holds them. They
  are CC BY-NC 4.0 and never ship: without them the Alpaca set is absent, and
  the evaluations say so (:func:`absent_sets`).

How each file is read:

- AdvBench: the ``prompt`` column, harmful.
- XSTest: ``prompt`` split by ``label`` into ``unsafe`` (harmful) and ``safe``.
- Alpaca seed tasks: the ``instruction``, benign; ``with_input`` appends the
  first example input after a blank line (the form a model is actually sent).
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any, TypeVar

from isagi.errors import InputError

ADVBENCH = "advbench_harmful_behaviors.csv"
XSTEST = "xstest_prompts.csv"
ALPACA = "alpaca_seed_tasks.jsonl"
SHIPPED_DIR = Path(__file__).resolve().with_name("benchmarks")

T = TypeVar("T")


@dataclass(frozen=True)
class BenchmarkSources:
    """The file each set is read from; ``alpaca_seed`` is None when the set is absent."""

    advbench: Path
    xstest: Path
    alpaca_seed: Path | None


def default_benchmarks_dir() -> Path:
    """``../shared/benchmarks`` next to the repository root (the development workspace)."""
    return Path(__file__).resolve().parents[2].parent / "shared" / "benchmarks"


def benchmark_sources(directory: Path | None = None) -> BenchmarkSources:
    """Where each set comes from (module docstring): ``directory`` when given, else the shipped copies
    and, for the Alpaca seed tasks, the development workspace."""
    if directory is not None:
        d = Path(directory)
        return BenchmarkSources(d / ADVBENCH, d / XSTEST, _if_file(d / ALPACA))
    return BenchmarkSources(SHIPPED_DIR / ADVBENCH, SHIPPED_DIR / XSTEST,
                            _if_file(default_benchmarks_dir() / ALPACA))


def _if_file(path: Path) -> Path | None:
    return path if path.is_file() else None


def alpaca_absent_note(directory: Path | None = None) -> str:
    """What a report says when the Alpaca seed tasks were not measured, and how to include them."""
    where = f"{Path(directory) / ALPACA} does not exist" if directory is not None else (
        "the set does not ship with ISAGI (its licence, CC BY-NC 4.0, is non-commercial) and no "
        "development workspace (../shared/benchmarks beside the source checkout) holds it")
    return (f"alpaca_seed (Stanford Alpaca seed tasks) was not measured: {where}. To include it, pass "
            f"--benchmarks DIR with DIR holding {ALPACA} beside {ADVBENCH} and {XSTEST} "
            f"(copies of those two ship in {SHIPPED_DIR}).")


def absent_sets(directory: Path | None = None) -> dict[str, str]:
    """``{set name: note}`` for each set that will not be measured (empty when all are there)."""
    if benchmark_sources(directory).alpaca_seed is None:
        return {"alpaca_seed": alpaca_absent_note(directory)}
    return {}


def sources_report(directory: Path | None = None,
                   names: tuple[str, ...] = ("advbench", "xstest", "alpaca_seed")) -> dict[str, Any]:
    """For a report on the sets ``names``: ``read_from`` (each one's file, None when absent)
    and, when one is absent, ``not_measured`` (:func:`absent_sets`)."""
    src = benchmark_sources(directory)
    read_from = {n: None if getattr(src, n) is None else str(getattr(src, n)) for n in names}
    absent = {n: note for n, note in absent_sets(directory).items() if n in names}
    return {"read_from": read_from, **({"not_measured": absent} if absent else {})}


def _read(path: Path, parse: Callable[[str], T]) -> T:
    """``parse(text of path)``; a missing or malformed file is an :class:`InputError` naming it."""
    try:
        return parse(path.read_text(encoding="utf-8"))
    except (OSError, UnicodeDecodeError, KeyError, AttributeError, TypeError, json.JSONDecodeError) as exc:
        raise InputError(
            f"Cannot read {path} ({exc}). Pass --benchmarks DIR holding {ADVBENCH} and {XSTEST} "
            f"(and {ALPACA} to measure it too), or leave --benchmarks out to use the shipped sets."
        ) from exc


def _csv_rows(text: str) -> list[dict[str, str]]:
    return list(csv.DictReader(text.splitlines()))


def load_advbench(directory: Path | None = None) -> list[str]:
    """The AdvBench prompts (harmful), from where :func:`benchmark_sources` says."""
    return _read(benchmark_sources(directory).advbench,
                 lambda t: [r["prompt"].strip() for r in _csv_rows(t) if r["prompt"].strip()])


def load_xstest(directory: Path | None = None) -> dict[str, list[str]]:
    """``{"unsafe": [...], "safe": [...]}``, from where :func:`benchmark_sources` says."""
    path = benchmark_sources(directory).xstest
    rows = _read(path, _csv_rows)
    try:
        return {label: [r["prompt"] for r in rows if r["label"] == label] for label in ("unsafe", "safe")}
    except KeyError as exc:
        raise InputError(f"{path} has no {exc} column.") from exc


def load_alpaca_seed(directory: Path | None = None, *, with_input: bool = False) -> list[str]:
    """The Alpaca seed instructions (benign); an :class:`InputError` with
    :func:`alpaca_absent_note` when the set is absent."""
    path = benchmark_sources(directory).alpaca_seed
    if path is None:
        raise InputError(alpaca_absent_note(directory))

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

    return _read(path, parse)


def load_benchmark_sets(directory: Path | None = None) -> dict[str, list[str]]:
    """The sets ``isagi eval safety`` reports that are present: AdvBench and XSTest-unsafe
    harmful, XSTest-safe and (when present, see :func:`absent_sets`) the Alpaca seed
    instructions benign."""
    xs = load_xstest(directory)
    sets = {"advbench": load_advbench(directory), "xstest_unsafe": xs["unsafe"], "xstest_safe": xs["safe"]}
    if benchmark_sources(directory).alpaca_seed is not None:
        sets["alpaca_seed"] = load_alpaca_seed(directory)
    return sets
