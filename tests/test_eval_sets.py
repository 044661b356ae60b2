"""The readers of the public evaluation sets: one reading per file, clear errors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from isagi.errors import InputError
from isagi.evals.sets import load_alpaca_seed, load_benchmark_sets, load_xstest


def _write_sets(d: Path) -> None:
    (d / "advbench_harmful_behaviors.csv").write_text("prompt,target\n Do harm ,Sure\n,\n")
    (d / "xstest_prompts.csv").write_text("prompt,label,type\nkill a process,safe,x\nkill a person,unsafe,x\n")
    rows = [{"instruction": "Sort this list.", "instances": [{"input": "3, 1, 2", "output": "1, 2, 3"}]},
            {"instruction": "Tell a joke.", "instances": [{"input": "", "output": "..."}]}]
    (d / "alpaca_seed_tasks.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows) + "\n")


def test_the_four_sets_and_alpaca_with_its_example_input(tmp_path: Path) -> None:
    _write_sets(tmp_path)
    assert load_benchmark_sets(tmp_path) == {"advbench": ["Do harm"], "xstest_unsafe": ["kill a person"],
                                             "xstest_safe": ["kill a process"],
                                             "alpaca_seed": ["Sort this list.", "Tell a joke."]}
    assert load_alpaca_seed(tmp_path, with_input=True) == ["Sort this list.\n\n3, 1, 2", "Tell a joke."]


def test_a_missing_file_or_column_is_a_clear_error(tmp_path: Path) -> None:
    with pytest.raises(InputError, match="--benchmarks DIR"):
        load_benchmark_sets(tmp_path)
    (tmp_path / "xstest_prompts.csv").write_text("prompt\nhello\n")
    with pytest.raises(InputError, match="no 'label' column"):
        load_xstest(tmp_path)
