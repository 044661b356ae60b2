"""The GPU path: the embedded default through transformers + bitsandbytes NF4 on CUDA.

This is what ``auto`` runs on a GPU box (and what the GPU Docker image runs).
CI has no GPU, so these tests skip there; on a machine with CUDA run them with
``pytest -m cuda tests/test_cuda_model.py``. They load the model twice: on
CUDA, and in NF4 on the CPU (the path every other model-tier test checks and
the shipped transformers profile was calibrated on), and check that the GPU
computes the same thing: the same states at the memory's and the safety
layer, the same TEH scores and refusal decisions under the shipped profile,
a streamed reply that stops when asked, steering that acts and leaves no hook
behind, and batches that match single prompts.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from isagi.config import Settings, load_settings
from isagi.engines.base import GenerationOptions
from isagi.engines.hf.hooks import count_forward_hooks
from tests.states import row_cosine

pytestmark = [
    pytest.mark.cuda,
    pytest.mark.model,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a GPU box: pytest -m cuda)"),
]

CHATS = [
    [{"role": "user", "content": "What is the capital of France?"}],
    [{"role": "system", "content": "You are a helpful assistant."},
     {"role": "user", "content": "Explain in two sentences why the sky looks blue during the day."}],
    [{"role": "user", "content": "Give me three ideas for a rainy Sunday afternoon with children."}],
]


@pytest.fixture(scope="module")
def cuda_settings(settings_default: Settings) -> Settings:
    """The test session's data directory, device left to ``auto`` (which must find the GPU)."""
    return load_settings(environ={}, home=settings_default.home, device="auto")


@pytest.fixture(scope="module")
def gpu(cuda_settings: Settings):
    from isagi.engines import load_engine

    return load_engine(cuda_settings)


def test_auto_runs_the_default_on_cuda_in_nf4(gpu, cuda_settings: Settings) -> None:
    import bitsandbytes as bnb

    from isagi.engines import choose_backend

    backend, why = choose_backend(cuda_settings)
    assert backend == "transformers" and "CUDA" in why
    assert gpu.backend == "transformers" and gpu.device.startswith("cuda") and gpu.quant == "nf4"
    linears = [m for m in gpu.model.modules() if isinstance(m, bnb.nn.Linear4bit)]
    assert len(linears) >= 7 * gpu.num_layers  # q, k, v, o, gate, up, down in every block
    assert all(m.weight.device.type == "cuda" for m in linears)


def test_cuda_states_match_the_cpu_nf4_path_at_both_layers(gpu, default_hf) -> None:
    """Same weights, same NF4 quantisation, bf16 compute on both: only kernel order differs."""
    layers = [gpu.default_layer, gpu.default_safety_layer]
    on_gpu = [next(gpu.iter_prompt_states([c], layers)) for c in CHATS]
    on_cpu = [next(default_hf.iter_prompt_states([c], layers)) for c in CHATS]
    for g, c, chat in zip(on_gpu, on_cpu, CHATS, strict=True):
        for layer in layers:
            assert g[layer].shape == c[layer].shape == (len(gpu.chat_tokens(chat)), gpu.hidden_size)
            cos = row_cosine(g[layer], c[layer])
            print(f"layer {layer}: per-token cosine GPU vs CPU min {cos.min():.4f} mean {cos.mean():.4f}")
            assert cos.min() >= 0.98 and cos.mean() >= 0.995


def test_the_shipped_profile_scores_and_decides_the_same_on_cuda(gpu, default_hf, cuda_settings: Settings) -> None:
    """The shipped transformers profile (calibrated on the CPU) is the one CUDA uses (the key has
    no device); on calibration rows, never evaluation sets, its scores and refusals agree."""
    from isagi.data.safety import load_safety_calibration
    from isagi.profile import key_for, load_or_build_profile, load_profile, shipped_profiles_dir
    from isagi.safety.build import safety_states
    from isagi.safety.runtime import teh

    key = key_for(gpu, cuda_settings)[0]
    assert load_profile(shipped_profiles_dir(), key) is not None, "no shipped profile for the CUDA engine's key"
    profile = load_or_build_profile(gpu, cuda_settings).safety
    rows = load_safety_calibration()
    rng = np.random.default_rng(0)
    pick = [rows[i] for i in rng.choice(len(rows), size=64, replace=False)]
    chats = [[{"role": "system", "content": cuda_settings.system_prompt}, {"role": "user", "content": r["text"]}]
             for r in pick]
    s_gpu = teh(profile, safety_states(gpu, chats, profile.read_layers))
    s_cpu = teh(profile, safety_states(default_hf, chats, profile.read_layers))
    corr = float(np.corrcoef(s_gpu, s_cpu)[0, 1])
    gap = np.abs(s_gpu - s_cpu)
    agree = np.mean((s_gpu >= profile.threshold) == (s_cpu >= profile.threshold))
    print(f"TEH GPU vs CPU on 64 calibration rows: corr {corr:.4f}, max |diff| {gap.max():.3f} "
          f"(threshold {profile.threshold:.3f}), decisions agree {agree:.3f}")
    assert corr >= 0.98
    clear = np.abs(s_cpu - profile.threshold) > 0.05 * profile.threshold  # rows not on the edge
    assert np.array_equal((s_gpu >= profile.threshold)[clear], (s_cpu >= profile.threshold)[clear])


def test_a_cuda_reply_streams_keeps_its_states_and_stops_when_asked(gpu) -> None:
    layer, safety = gpu.default_layer, gpu.default_safety_layer
    with gpu.generation(CHATS[0], layer, GenerationOptions(max_new_tokens=32), also_capture=(safety,)) as gen:
        h = gen.prefill()
        reply = "".join(e.text for e in gen.stream())
        states = gen.reply_hidden(safety)
    assert "Paris" in reply and h.shape == (gpu.hidden_size,) and np.isfinite(h).all()
    assert states.shape[1] == gpu.hidden_size and len(states) >= 1 and np.isfinite(states).all()
    opts = GenerationOptions(max_new_tokens=64, ignore_eos=True)
    with gpu.generation(CHATS[2], layer, opts) as gen:
        gen.prefill()
        for n, _event in enumerate(gen.stream(), 1):
            if n == 3:
                gen.stop()
        assert gen.finish_reason == "cancelled" and len(gen.new_ids) == 3


def test_steering_on_cuda_changes_the_reply_and_leaves_no_hook(gpu) -> None:
    layer = gpu.default_layer
    before = count_forward_hooks(gpu.model)
    opts = GenerationOptions(max_new_tokens=16, ignore_eos=True)
    with gpu.generation(CHATS[2], layer, opts) as gen:
        plain_h = gen.prefill()
        list(gen.stream())
        plain = list(gen.new_ids)
    steer = np.random.default_rng(1).standard_normal(gpu.hidden_size).astype(np.float32)
    steer *= 4 * np.linalg.norm(plain_h) / np.linalg.norm(steer)
    with gpu.generation(CHATS[2], layer, opts, steer=steer) as gen:
        steered_h = gen.prefill()
        list(gen.stream())
        steered = list(gen.new_ids)
    assert count_forward_hooks(gpu.model) == before
    np.testing.assert_allclose(steered_h, plain_h, rtol=1e-3, atol=1e-2)  # captured before the vector is added
    assert steered != plain


def test_cuda_batches_match_one_prompt_at_a_time(gpu) -> None:
    layer = gpu.default_safety_layer
    batched = list(gpu.iter_prompt_states(CHATS, [layer], batch_size=len(CHATS)))
    alone = [next(gpu.iter_prompt_states([c], [layer])) for c in CHATS]
    for got, ref in zip(batched, alone, strict=True):
        cos = row_cosine(got[layer], ref[layer])
        assert got[layer].shape == ref[layer].shape and cos.min() >= 0.99
