"""`isagi eval ogd` end to end on the tiny engine: with and without the Alpaca seed tasks."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isagi.evals import ogd, sets
from tests.tiny_engine import tiny_engine


def _run(home: Path, benchmarks_dir: Path | None = None) -> dict:
    engine = tiny_engine(home, with_store=False)
    return ogd.run(engine.lm, engine.profile.safety, seeds=["the sea"], n_prompts=2, max_new_tokens=3,
                   benchmarks_dir=benchmarks_dir, system_prompt=engine.settings.system_prompt,
                   pipeline=ogd.pipeline_turn(engine))


def test_without_alpaca_only_advbench_is_measured_and_the_report_says_so(
        monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sets, "default_benchmarks_dir", lambda: tmp_path / "absent")
    report = _run(tmp_path)
    ablation = report["ablation"]
    assert ablation["advbench"]["n"] == 2 and "alpaca_seed" not in ablation
    assert list(ablation["pipeline"]) == ["advbench"]
    assert report["read_from"] == {"advbench": str(sets.SHIPPED_DIR / sets.ADVBENCH), "alpaca_seed": None}
    assert "--benchmarks DIR" in report["not_measured"]["alpaca_seed"]


def test_with_alpaca_both_sets_are_measured(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setattr(sets, "default_benchmarks_dir", lambda: tmp_path / "absent")
    given = tmp_path / "given"
    given.mkdir()
    for name in (sets.ADVBENCH, sets.XSTEST):
        (given / name).write_bytes((sets.SHIPPED_DIR / name).read_bytes())
    rows = [{"instruction": f"Name a colour ({i}).", "instances": [{"input": ""}]} for i in range(3)]
    (given / sets.ALPACA).write_text("".join(json.dumps(r) + "\n" for r in rows))
    report = _run(tmp_path, given)
    alpaca = report["ablation"]["alpaca_seed"]
    assert alpaca["n"] == 2 and set(alpaca) == {"n", "ppl_plain", "ppl_ablated", "refusal_rate_plain",
                                                "refusal_rate_ablated"}
    assert alpaca["ppl_plain"] > 0 and list(report["ablation"]["pipeline"]) == ["advbench", "alpaca_seed"]
    assert report["read_from"]["alpaca_seed"] == str(given / sets.ALPACA) and "not_measured" not in report
