"""The engine seam without a real model: backend choice, settings, pooling, and the
protocol as the transformers engine implements it on a tiny random model."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from isagi.config import load_settings
from isagi.engines import choose_backend
from isagi.engines.base import Decoding, GenerationOptions, ModelEngine, span_by_difference
from isagi.engines.hf.engine import TransformersEngine
from isagi.errors import ConfigError
from isagi.manifold.pooling import (
    decoding_state,
    last_token,
    pool_states,
    prompt_hidden_states_at,
    span_mean,
)
from tests.conftest import tiny_model


class _ByteTok:
    pad_token_id = 0
    eos_token_id = 1
    unk_token_id = None

    def __call__(self, text: str, add_special_tokens: bool = False) -> dict:
        return {"input_ids": [2 + b % 250 for b in text.encode()]}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return "".join(chr(97 + int(i) % 26) for i in ids)


class _TinyLoaded:
    """LoadedModel-like: a tiny random Llama with a byte 'chat template'."""

    def __init__(self) -> None:
        self.model = tiny_model("llama")
        self.tokenizer = _ByteTok()
        self.device = torch.device("cpu")
        self.stop_token_ids = {1}
        self.num_layers = 4
        self.hidden_size = 64
        self.default_layer = 2

    def chat_ids(self, messages: list[dict[str, str]]) -> torch.Tensor:
        text = "".join(f"<{m['role']}>{m['content']}</>" for m in messages) + "<assistant>"
        return torch.tensor([[2 + b % 250 for b in text.encode()]], dtype=torch.long)

    def content_span(self, messages: list[dict[str, str]]) -> tuple[int, int]:
        full = self.chat_ids(messages)[0].tolist()
        empty = self.chat_ids([*messages[:-1], {**messages[-1], "content": ""}])[0].tolist()
        return span_by_difference(full, empty)


@pytest.fixture()
def engine() -> TransformersEngine:
    return TransformersEngine(_TinyLoaded(), backend_reason="test")


CHAT = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]


# -- backend choice -------------------------------------------------------------


def _settings(tmp_path, **kw):
    return load_settings(environ={}, home=tmp_path, device=kw.pop("device", "cpu"), **kw)


def test_auto_picks_llamacpp_for_the_default_and_gguf_files_on_cpu(tmp_path) -> None:
    assert choose_backend(_settings(tmp_path))[0] == "llamacpp"
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    backend, why = choose_backend(_settings(tmp_path, model=str(gguf)))
    assert backend == "llamacpp" and "gguf" in why.lower()


def test_auto_picks_transformers_for_hub_ids_directories_and_cuda(tmp_path) -> None:
    assert choose_backend(_settings(tmp_path, model="HuggingFaceTB/SmolLM2-135M-Instruct"))[0] == "transformers"
    (tmp_path / "hf").mkdir()
    assert choose_backend(_settings(tmp_path, model=str(tmp_path / "hf")))[0] == "transformers"
    backend, why = choose_backend(_settings(tmp_path, device="cuda"))
    assert backend == "transformers" and "CUDA" in why


def test_impossible_combinations_are_one_clear_error(tmp_path) -> None:
    with pytest.raises(ConfigError, match="needs a GGUF model"):
        choose_backend(_settings(tmp_path, backend="llamacpp", model="someone/some-model"))
    gguf = tmp_path / "m.gguf"
    gguf.write_bytes(b"GGUF")
    with pytest.raises(ConfigError, match="cannot load the GGUF"):
        choose_backend(_settings(tmp_path, backend="transformers", model=str(gguf)))
    with pytest.raises(ConfigError, match="CPU"):
        choose_backend(_settings(tmp_path, backend="llamacpp", device="cuda"))


def test_backend_and_threads_settings_are_read_and_checked(tmp_path) -> None:
    s = load_settings(environ={"ISAGI_BACKEND": "LlamaCpp", "ISAGI_THREADS": "3", "ISAGI_HOME": str(tmp_path)})
    assert s.backend == "llamacpp" and s.threads == 3
    with pytest.raises(ConfigError, match="backend 'vllm' is unknown"):
        load_settings(environ={"ISAGI_BACKEND": "vllm"})
    with pytest.raises(ConfigError, match="ISAGI_THREADS"):
        load_settings(environ={"ISAGI_THREADS": "0"})


def test_the_profile_key_depends_on_the_backend() -> None:
    from isagi.profile import profile_key

    args = ("gguf-sha256:x", "gguf", 20, 64, "sys", 18)
    assert profile_key(*args, "llamacpp") != profile_key(*args, "transformers")


# -- pooling above the seam -----------------------------------------------------


def test_pooling_picks_the_last_token_or_the_span_mean() -> None:
    states = np.arange(12, dtype=np.float32).reshape(4, 3)
    assert np.array_equal(last_token(states), states[-1])
    assert np.allclose(span_mean(states, (1, 3)), states[1:3].mean(0))
    assert np.allclose(pool_states(states, "content", (0, 4)), states.mean(0))
    with pytest.raises(ValueError, match="span"):
        pool_states(states, "content")
    with pytest.raises(ValueError, match="pool="):
        pool_states(states, "max")


def test_post_instruction_read_outs_average_the_tokens_after_the_message() -> None:
    states = np.arange(18, dtype=np.float32).reshape(6, 3)  # message (1, 3), template tokens 3..5
    post = states[3:].mean(0)
    assert np.allclose(pool_states(states, "post", (1, 3)), post)
    # the average of the two means, not the mean over [1, 6): the 3 template tokens weigh as much as the message
    assert np.allclose(pool_states(states, "content+post", (1, 3)), (states[1:3].mean(0) + post) / 2)
    assert not np.allclose(pool_states(states, "content+post", (1, 3)), states[1:].mean(0))
    # nothing after the message: the last token stands in rather than an empty mean (NaN)
    assert np.allclose(pool_states(states, "post", (1, 6)), states[-1])


def test_decoding_state_reads_the_same_spans_from_an_open_decoding() -> None:
    states = np.random.default_rng(0).normal(size=(7, 4)).astype(np.float32)

    class Open:
        prompt_tokens = 7

        def prompt_state(self, layer: int, span: tuple[int, int]) -> np.ndarray:
            assert layer == 5
            return span_mean(states, span)

    for how in ("content", "post", "content+post", "last"):
        assert np.allclose(decoding_state(Open(), 5, how, (2, 4)), pool_states(states, how, (2, 4)), atol=1e-6)


def test_span_by_difference_finds_the_message_and_stands_in_for_an_empty_one() -> None:
    assert span_by_difference([1, 2, 7, 8, 3], [1, 2, 3]) == (2, 4)
    assert span_by_difference([1, 2, 3], [1, 2, 3]) == (2, 3)


# -- the protocol on the transformers engine -----------------------------------


def test_the_transformers_engine_implements_the_protocol(engine) -> None:
    assert isinstance(engine, ModelEngine)
    assert engine.backend == "transformers" and engine.context_length == 256 and engine.vocab_size == 256
    with engine.generation(CHAT, 2, GenerationOptions(max_new_tokens=3)) as gen:
        assert isinstance(gen, Decoding)
    ids = engine.chat_tokens(CHAT)
    a, b = engine.content_span(CHAT)
    assert bytes(t - 2 for t in ids[a:b]).decode() == "hello there"
    assert engine.count_tokens("hello") == 5


def test_prefill_hands_back_every_prompt_token_state_at_each_layer(engine) -> None:
    ids = torch.tensor([engine.chat_tokens(CHAT)])
    with torch.inference_mode():
        ref = engine.model(ids, output_hidden_states=True).hidden_states
    with engine.generation(CHAT, 2, also_capture=(3,)) as gen:
        h = gen.prefill()
        np.testing.assert_allclose(gen.prompt_states(2), ref[2][0].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gen.prompt_states(3), ref[3][0].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(h, ref[2][0, -1].numpy(), rtol=1e-5, atol=1e-5)
        with pytest.raises(ValueError, match="also_capture"):
            gen.prompt_states(1)


def test_streaming_keeps_reply_states_and_stops_between_tokens(engine) -> None:
    opts = GenerationOptions(max_new_tokens=6, ignore_eos=True)
    with engine.generation(CHAT, 2, opts, also_capture=(3,)) as gen:
        gen.prefill()
        for n, _event in enumerate(gen.stream(), 1):
            if n == 4:
                gen.stop()
        assert gen.finish_reason == "cancelled" and len(gen.new_ids) == 4
        assert gen.reply_hidden(3).shape == (3, 64)  # the 4th token was never fed back


def test_batched_prompt_states_match_one_prompt_at_a_time(engine) -> None:
    chats = [CHAT, [{"role": "user", "content": "a much longer message than the other one"}]]
    batched = list(engine.iter_prompt_states(chats, [2, 3], batch_size=2))
    alone = [next(engine.iter_prompt_states([c], [2, 3])) for c in chats]
    for got, ref, chat in zip(batched, alone, chats, strict=True):
        assert got[3].shape == (len(engine.chat_tokens(chat)), 64)
        np.testing.assert_allclose(got[3], ref[3], rtol=1e-4, atol=1e-4)
    pooled = prompt_hidden_states_at(engine, chats, [2, 3], pool="content")
    a, b = engine.content_span(chats[1])
    np.testing.assert_allclose(pooled[3][1], ref[3][a:b].mean(0), rtol=1e-4, atol=1e-4)


def test_prompt_states_stop_after_the_last_layer_read(engine) -> None:
    """Prompt states alone never run the layers above the ones read (nor the output head), and the
    model is left with no hook of ours."""
    from isagi.engines.hf.hooks import count_forward_hooks, layer_module

    top = layer_module(engine.model, engine.num_layers)
    calls: list[int] = []
    handle = top.register_forward_hook(lambda *_: calls.append(1))
    try:
        before = count_forward_hooks(engine.model)
        got = list(engine.iter_prompt_states([CHAT, CHAT], [2], batch_size=2))
        assert calls == [] and count_forward_hooks(engine.model) == before
        assert got[0][2].shape == (len(engine.chat_tokens(CHAT)), 64)
        list(engine.iter_prompt_states([CHAT], [engine.num_layers]))
        assert calls == [1]  # the top layer runs when it is the one read
    finally:
        handle.remove()


def test_reply_states_and_reply_nll(engine) -> None:
    states = engine.reply_states([CHAT, CHAT], 2, max_new_tokens=5)
    assert len(states) == 2 and all(s.shape[1] == 64 and len(s) <= 5 for s in states)
    np.testing.assert_allclose(states[0], states[1], rtol=1e-4, atol=1e-4)
    # several layers: their states side by side, each as it is alone (the reply guard reads them so)
    both = engine.reply_states([CHAT], [1, 2], max_new_tokens=5)[0]
    assert both.shape == (len(states[0]), 128)
    np.testing.assert_allclose(both[:, 64:], states[0], rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(both[:, :64], engine.reply_states([CHAT], 1, max_new_tokens=5)[0], rtol=1e-4, atol=1e-4)
    ids = torch.tensor([engine.chat_tokens(CHAT) + [5, 6]])
    with torch.inference_mode():
        logp = torch.log_softmax(engine.model(ids).logits[0].float(), -1)
    p = ids.shape[1] - 2
    expected = -(logp[p - 1, 5] + logp[p, 6]).item() / 2
    assert engine.reply_nll(CHAT, [5, 6]) == pytest.approx(expected, rel=1e-4)


def test_isagi_blas_keeps_to_one_thread_beside_the_model() -> None:
    """OpenBLAS threads busy-wait after each call and take the cores from the model's threads:
    ISAGI's own small linear algebra runs on one (isagi.engines.cpu_share)."""
    from threadpoolctl import threadpool_info

    from isagi.engines.cpu_share import keep_blas_single_threaded

    keep_blas_single_threaded()
    blas = {p["filepath"]: p["num_threads"] for p in threadpool_info() if p["user_api"] == "blas"}
    ours = {path: n for path, n in blas.items() if "numpy" in path or "faiss" in path}
    assert any("numpy" in path for path in ours) and any("faiss" in path for path in ours), blas
    assert set(ours.values()) == {1}
