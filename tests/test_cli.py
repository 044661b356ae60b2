"""The ``isagi`` command line as a user runs it (a real subprocess)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import pytest

import isagi


def _isagi(args: list[str], home: Path, stdin: str | None = None, timeout: int = 900) -> subprocess.CompletedProcess:
    env = {k: v for k, v in os.environ.items() if not k.startswith("ISAGI_")}
    env.update({"ISAGI_HOME": str(home), "HF_HUB_OFFLINE": "1", "ISAGI_DEVICE": "cpu"})
    return subprocess.run([sys.executable, "-m", "isagi.cli", *args], input=stdin, capture_output=True,
                          text=True, env=env, timeout=timeout)


def test_version(tmp_path: Path) -> None:
    out = _isagi(["--version"], tmp_path)
    assert out.returncode == 0 and isagi.__version__ in out.stdout


@pytest.mark.parametrize("model", ["/no/such/model/dir", "no-such-org/no-such-model-xyz"])
def test_wrong_model_is_one_line_error(tmp_path: Path, model: str) -> None:
    out = _isagi(["chat", "--model", model], tmp_path, stdin="hello\n", timeout=300)
    assert out.returncode == 2
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert lines[-1].startswith("error:"), out.stderr
    assert "Traceback" not in out.stderr
    assert model in out.stderr


def test_bad_setting_is_one_line_error(tmp_path: Path) -> None:
    out = _isagi(["info", "--quant", "int2"], tmp_path)
    assert out.returncode == 2 and "nf4, none" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.parametrize(("args", "message"), [
    (["--layers", "15,x"], "--layers '15,x'"),
    (["--probe", "logistic:0"], "write logistic:C"),
    (["--probe", "logistic:-1"], "write logistic:C"),
    (["--probe", "mlp:x"], "mlp:UNITS"),
    (["--probe", "forest"], "write logistic:C"),
])
def test_safety_cv_bad_options_are_one_line_errors_before_loading(tmp_path: Path, args: list[str], message: str) -> None:
    out = _isagi(["eval", "safety-cv", *args], tmp_path, timeout=120)
    assert out.returncode == 2 and message in out.stderr and "Traceback" not in out.stderr, out.stderr


@pytest.mark.model
def test_piped_chat_answers_each_line(settings_default) -> None:
    out = _isagi(["chat"], settings_default.home,
                 stdin="What is the capital of France?\nWhat is the capital of Italy?\n")
    assert out.returncode == 0, out.stderr
    replies = out.stdout.strip("\n").split("\n")
    assert len(replies) == 2, out.stdout
    assert "Paris" in replies[0]
    assert "Rome" in replies[1]


@pytest.mark.model
def test_profile_show_prints_the_safety_calibration_and_its_roc(settings_default) -> None:
    """``isagi profile show --json`` exposes what the guard runs on: the stored ROC
    (monotone, from (0, 0) to (1, 1)) and a threshold on it within the stated FPR budget."""
    import json

    out = _isagi(["profile", "show", "--json"], settings_default.home)
    assert out.returncode == 0, out.stderr
    data = json.loads(out.stdout)
    roc = data["roc"]
    assert data["safety_layer"] >= 1 and data["forbidden_dims"] >= 1
    assert len(roc["thresholds"]) == len(roc["tpr"]) == len(roc["fpr"]) >= 2
    assert roc["tpr"][0] == roc["fpr"][0] == 0.0 and roc["tpr"][-1] == roc["fpr"][-1] == 1.0
    assert all(b >= a for a, b in zip(roc["tpr"], roc["tpr"][1:], strict=False))
    # the ROC is out of fold; the threshold keeps each kind of benign prompt within its budget
    # there, so all of them together are within the larger one
    rule = data["threshold_rule"]
    assert rule["ordinary_fpr"] <= rule["ordinary_budget"] and rule["lookalike_fpr"] <= rule["lookalike_budget"]
    assert roc["threshold"] == data["teh_threshold"]
    assert 0.0 <= roc["fpr_at_threshold"] <= max(rule["ordinary_budget"], rule["lookalike_budget"])
    assert 0.5 < data["safety_cv"]["oof_auc"] <= 1.0 and data["safety_read_layers"][-1] == data["safety_layer"]


def test_web_on_a_taken_port_is_one_line_error_before_loading(tmp_path: Path) -> None:
    import socket

    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen(1)
        port = taken.getsockname()[1]
        out = _isagi(["web", "--port", str(port)], tmp_path, timeout=120)
    assert out.returncode == 2, out.stderr
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert len(lines) == 1 and lines[0].startswith("error:"), out.stderr
    assert f"--port {port + 1}" in out.stderr and f"PORT={port + 1}" in out.stderr
    # refused before anything was loaded or written
    assert not (tmp_path / "models").exists() and not (tmp_path / "profiles").exists()


def test_a_backend_that_cannot_load_the_model_is_one_line_error(tmp_path: Path) -> None:
    out = _isagi(["info", "--backend", "llamacpp", "--model", "someone/some-model"], tmp_path, timeout=300)
    lines = [ln for ln in out.stderr.strip().splitlines() if ln.strip()]
    assert out.returncode == 2 and lines[-1].startswith("error:") and "needs a GGUF model" in out.stderr
    assert "Traceback" not in out.stderr
    out = _isagi(["info", "--backend", "vllm"], tmp_path, timeout=300)
    assert out.returncode == 2 and "auto, llamacpp, transformers" in out.stderr and "Traceback" not in out.stderr


@pytest.mark.model
def test_info_states_the_slots_and_what_their_kv_caches_take(tmp_path: Path) -> None:
    import json

    sizes = {}
    for n in (1, 4):
        out = _isagi(["info", "--backend", "llamacpp", "--parallel", str(n), "--json"], tmp_path, timeout=300)
        assert out.returncode == 0, out.stderr
        facts = json.loads(out.stdout)
        assert facts["parallel"] == n
        sizes[n] = facts["kv_cache_mb"]
    assert sizes[1] > 0 and sizes[4] == pytest.approx(4 * sizes[1], rel=0.01), "each slot holds a whole context"
    from isagi.config import SERVER_PARALLEL

    out = _isagi(["info", "--backend", "llamacpp", "--json"], tmp_path, timeout=300)
    assert json.loads(out.stdout)["parallel"] == SERVER_PARALLEL, "without --parallel: what isagi web opens"
    out = _isagi(["info", "--parallel", "0"], tmp_path)
    assert out.returncode == 2 and "ISAGI_PARALLEL" in out.stderr and "Traceback" not in out.stderr
