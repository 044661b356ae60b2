"""``isagi bench batch`` on the real default model: the anchor is plain llama.cpp doing what
ISAGI's engine does, so with one sequence it decodes ISAGI's greedy reply token for token,
and every width reports both sides' speeds from the same run."""

from __future__ import annotations

import pytest

from isagi.config import load_settings
from isagi.errors import InputError


@pytest.mark.model
def test_bench_batch_reports_both_sides_and_the_single_sequence_anchor_matches_isagi(tmp_path):
    from isagi.bench.batch import run

    out = run(load_settings(environ={}, home=tmp_path, device="cpu"), new_tokens=12, repeats=1, widths=(2, 1))
    assert list(out["widths"]) == ["1", "2"], "widths in order, the narrowest first"
    one, two = out["widths"]["1"], out["widths"]["2"]
    assert one["same_replies"] == "1/1", "one sequence in the anchor's context: ISAGI's greedy reply exactly"
    assert one["anchor_over_single"] == one["isagi_over_single"] == 1.0
    for w in (one, two):
        assert w["anchor_tokens_per_s"]["median"] > 0 and w["isagi_tokens_per_s"]["median"] > 0
        # decoding alone is faster than decoding and prefilling
        assert w["anchor_decode_tokens_per_s"]["median"] > w["anchor_tokens_per_s"]["median"]
        assert w["vs_anchor"] == pytest.approx(
            w["isagi_decode_tokens_per_s"]["median"] / w["anchor_decode_tokens_per_s"]["median"], rel=0.02)


def test_bench_batch_refuses_widths_it_cannot_run(tmp_path):
    from isagi.bench.batch import run

    for widths in ((0, 2), (1, 99), ()):
        with pytest.raises(InputError, match="--widths"):
            run(load_settings(environ={}, home=tmp_path, device="cpu"), widths=widths)
