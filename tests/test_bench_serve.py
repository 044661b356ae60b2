"""``isagi bench serve``: its questions, its figures and the anchor's build settings (fast), and
one tiny side-by-side run of the real ``isagi serve`` and llama.cpp's ``llama-server`` (marked)."""

from __future__ import annotations

import os
import re
from pathlib import Path

import pytest

from isagi.bench import anchor_build, anchor_server
from isagi.bench.serve import Options, _figures, _summary, run
from isagi.bench.serve_load import QUESTIONS, TASKS, Turns, number, question
from isagi.errors import AnchorError, InputError

ROOT = Path(__file__).resolve().parents[1]


def test_every_question_of_a_run_differs_and_the_numbers_do_not_overlap() -> None:
    texts = [question(n) for n in range(3 * QUESTIONS)]
    assert len(set(texts)) == len(texts)
    assert all(t.endswith(("?", ".")) for t in texts[:QUESTIONS])
    # users x conversations x turns of one run take consecutive numbers from the run's first
    users, turns = 3, 4
    got = sorted(number(10, users, turns, u, c, t) for u in range(users) for c in range(2) for t in range(turns))
    assert got == list(range(10, 10 + users * 2 * turns))
    assert len(TASKS) == len(set(TASKS))


def test_the_anchor_is_compiled_with_the_makefiles_amx_flags() -> None:
    makefile = (ROOT / "Makefile").read_text()
    assert f"NO_AMX := {anchor_build.NO_AMX}" in makefile
    env = anchor_build.compiler_env()
    if os.uname().machine == "x86_64":
        assert env["CFLAGS"].endswith(anchor_build.NO_AMX) and env["CXXFLAGS"].endswith(anchor_build.NO_AMX)
    # the web UI's assets would be downloaded from Hugging Face: never
    assert "-DLLAMA_USE_PREBUILT_UI=OFF" in anchor_build.CMAKE_OPTIONS


def test_the_anchor_is_cached_per_llama_cpp_python_version(tmp_path: Path) -> None:
    path = anchor_build.cached_path(tmp_path, "0.3.99")
    assert path == tmp_path / "anchor" / "llama-cpp-python-0.3.99" / "llama-server"
    with pytest.raises(AnchorError, match="--anchor"):
        anchor_build.ensure(tmp_path, tmp_path / "missing")
    binary = tmp_path / "llama-server"
    binary.write_text("#!/bin/sh\n")
    binary.chmod(0o755)
    assert anchor_build.ensure(tmp_path, binary) == binary


def test_llama_server_runs_isagis_engine_settings() -> None:
    args = anchor_server.arguments(Path("m.gguf"), threads=2, ctx_per_slot=2368, slots=8, port=1234)
    joined = " ".join(args)
    for part in ("-m m.gguf", "-t 2", "-tb 2", "-c 18944", "-np 8", "--no-kv-unified", "-fa off", "--jinja",
                 "--port 1234", "--host 127.0.0.1"):
        assert part in joined, part


def test_isagis_prompt_text_is_the_gguf_template_with_the_system_prompt_sent() -> None:
    from isagi.engines.hf.model import default_gguf_path

    facts = anchor_server.model_facts(default_gguf_path())
    assert facts.trained_context == 8192 and (facts.bos, facts.eos) == ("<|im_start|>", "<|im_end|>")
    text = anchor_server.isagi_prompt_text(facts, [
        {"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi?"}])
    assert text.startswith("<|im_start|>system\nBe brief.<|im_end|>")
    assert text.endswith("<|im_start|>user\nHi?<|im_end|>\n<|im_start|>assistant\n")
    assert "SmolLM" not in text  # the GGUF's own system prompt only comes without one


def _turns(latency: list[float], ttft: list[float], tokens: int) -> Turns:
    t = Turns()
    t.latency, t.ttft, t.tokens = latency, ttft, [tokens] * len(latency)
    t.decode_s_per_token = [(lat - first) / (tokens - 1) for lat, first in zip(latency, ttft, strict=True)]
    return t


def test_figures_pool_the_rounds_and_the_best_setting_is_the_lowest_p95() -> None:
    one = _figures([(_turns([1.0, 2.0], [0.1, 0.2], 5), 4.0, (0.5, 0.7)),
                    (_turns([3.0], [0.3], 5), 2.0, (0.7, 0.9))], "np_1")
    assert one["turns"] == 3 and one["turns_per_s"] == round(3 / 6, 3) and one["tokens_per_s"] == round(15 / 6, 2)
    assert one["p50_s"] == 2.0 and one["ttft_p50_s"] == 0.2 and one["loadavg_1m"] == [[0.5, 0.7], [0.7, 0.9]]
    eight = _figures([(_turns([1.5, 1.6, 1.7], [0.05, 0.06, 0.07], 5), 3.0, (1.0, 1.0))], "np_8")
    s = _summary({"np_1": one, "np_8": eight})
    assert s["best"] == "np_8" and s["p95_s"] == eight["p95_s"] and s["best_ttft"] == "np_8"
    assert s["settings"]["np_1"] is one


def test_wrong_options_are_refused_before_anything_is_built(tmp_path: Path) -> None:
    from isagi.config import load_settings

    settings = load_settings(environ={}, home=tmp_path)
    with pytest.raises(InputError, match="--users"):
        run(settings, Options(users=(0,)))
    with pytest.raises(InputError, match="parallel"):
        run(settings, Options(isagi_parallel=(0,)))


def _anchor_binary(home: Path) -> Path | None:
    """A built llama-server: ISAGI_TEST_ANCHOR, else the cached build in the tests' data directory
    or the user's; None when there is none (the test then says how to make one)."""
    if env := os.environ.get("ISAGI_TEST_ANCHOR"):
        return Path(env)
    for base in (home, Path.home() / ".isagi"):
        path = anchor_build.cached_path(base)
        if path.is_file():
            return path
    return None


@pytest.mark.model
@pytest.mark.slow
@pytest.mark.anchor
def test_a_tiny_side_by_side_run_reports_every_field_for_both_servers(settings_default, tmp_path: Path,
                                                                      anchor_built_in_background) -> None:
    if os.environ.get("ISAGI_TEST_BUILD_ANCHOR") == "1" and _anchor_binary(settings_default.home) is None:
        anchor_build.ensure(settings_default.home)  # minutes: the first run only (or the background build failed)
    binary = _anchor_binary(settings_default.home)
    if binary is None:
        pytest.skip("no llama-server built: run `isagi bench serve` once (it builds and caches one, minutes on "
                    "2 cores), set ISAGI_TEST_ANCHOR=/path/to/llama-server, or ISAGI_TEST_BUILD_ANCHOR=1 "
                    "to build it here")
    got = run(settings_default, Options(users=(1,), isagi_parallel=(1,), anchor_parallel=(1,), threads=1, turns=2,
                                        duration_s=None, max_tokens=8, anchor=binary))
    (row,) = got["runs"]
    assert row["users"] == 1
    fields = {"setting", "turns", "unfinished", "not_reached", "errors", "p50_s", "p95_s", "ttft_p50_s",
              "ttft_p95_s", "decode_ms_per_token_p50", "turns_per_s", "tokens_per_s", "reply_tokens_mean",
              "loadavg_1m", "wall_s", "tiers", "session_changes", "error_samples"}
    for server, name in (("isagi", "parallel_1"), ("anchor", "np_1")):
        summary = row[server]
        assert summary["best"] == summary["best_ttft"] == name, summary
        fig = summary["settings"][name]
        assert set(fig) == fields
        assert fig["turns"] == 2 and fig["errors"] == fig["unfinished"] == fig["not_reached"] == 0, fig["error_samples"]
        assert 0 < fig["ttft_p50_s"] <= fig["p50_s"] <= fig["p95_s"]
        assert fig["turns_per_s"] > 0 and fig["tokens_per_s"] > 0 and 0 < fig["reply_tokens_mean"] <= 8
        assert summary["p95_s"] == fig["p95_s"] and summary["ttft_p50_s"] == fig["ttft_p50_s"]
    assert sum(row["isagi"]["settings"]["parallel_1"]["tiers"].values()) == 2
    assert row["isagi"]["settings"]["parallel_1"]["session_changes"] == 0  # one conversation, one session
    assert row["ratio_p95"] == round(row["isagi"]["p95_s"] / row["anchor"]["p95_s"], 3)
    assert row["ratio_ttft"] == round(row["isagi"]["ttft_p50_s"] / row["anchor"]["ttft_p50_s"], 3)
    check = got["prompt_check"]
    assert check["same_prompt_text"] is True  # llama-server renders ISAGI's prompt, system prompt included
    assert check["isagi_reply"] and check["anchor_reply"]
    assert got["warmup_errors"] == [] and got["threads"] == 1
    assert re.search(r"-np 1\b", " ".join(got["anchor"]["args"]))
