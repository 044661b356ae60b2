"""Hidden-state capture and decoding on tiny random Llama and Qwen2 models (no download)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from isagi.engines.hf.generation import Generation, GenerationOptions, _Detokenizer
from isagi.engines.hf.hooks import count_forward_hooks
from isagi.engines.hf.model import LoadedModel, decoder_layers
from isagi.errors import ModelStructureError
from tests.conftest import tiny_model


class ByteTokenizer:
    """Just enough of a tokenizer for decoding: ids are bytes, id 0 ends a reply."""

    eos_token_id = 0
    unk_token_id = None
    pad_token_id = 0

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i != 0).decode("utf-8", errors="replace")

    def convert_tokens_to_ids(self, token: str) -> None:
        return None

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> dict[str, torch.Tensor]:
        """A byte-level stand-in template: "role: content" lines, then "assistant:"."""
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return {"input_ids": torch.tensor([list(text.encode())], dtype=torch.long)}


def _lm(kind: str) -> LoadedModel:
    model = tiny_model(kind)
    model.generation_config.eos_token_id = 0
    return LoadedModel(model=model, tokenizer=ByteTokenizer(), model_id=f"tiny-{kind}", source="config",
                       fingerprint="test", quant="none", device=torch.device("cpu"), device_reason="test")


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
@pytest.mark.parametrize("layer", [1, 2, 3])
def test_captured_h_equals_output_hidden_states(kind: str, layer: int) -> None:
    lm = _lm(kind)
    ids = torch.randint(1, 256, (1, 17), generator=torch.Generator().manual_seed(layer))
    with Generation(lm, ids, layer) as gen:
        h = gen.prefill()
    with torch.inference_mode():
        ref = lm.model(input_ids=ids, output_hidden_states=True).hidden_states[layer][0, -1].numpy()
    np.testing.assert_allclose(h, ref, rtol=0, atol=1e-5)


@pytest.mark.parametrize("kind", ["llama", "qwen2"])
def test_decoding_from_prefill_cache_matches_generate(kind: str) -> None:
    """Greedy decoding from the prefill's KV cache gives exactly model.generate's tokens."""
    lm = _lm(kind)
    ids = torch.randint(1, 256, (1, 9), generator=torch.Generator().manual_seed(3))
    opts = GenerationOptions(max_new_tokens=12, ignore_eos=True)
    with Generation(lm, ids, 2, opts) as gen:
        gen.prefill()
        list(gen.stream())
        states = gen.reply_hidden()
    with torch.inference_mode():
        ref = lm.model.generate(ids, max_new_tokens=12, min_new_tokens=12, do_sample=False,
                                eos_token_id=0, pad_token_id=0)
    assert gen.new_ids == ref[0, ids.shape[1]:].tolist()
    # The hook kept one hidden state per reply token fed back (all but the last).
    assert states.shape == (11, lm.hidden_size)


def test_exception_inside_generation_leaves_no_hook() -> None:
    lm = _lm("llama")
    ids = torch.randint(1, 256, (1, 5))
    before = count_forward_hooks(lm.model)
    with pytest.raises(RuntimeError, match="boom"), Generation(lm, ids, 2, GenerationOptions(max_new_tokens=5)) as gen:
        gen.prefill()
        assert count_forward_hooks(lm.model) == before + 1
        for _ in gen.stream():
            raise RuntimeError("boom")
    assert count_forward_hooks(lm.model) == before


def test_exception_inside_a_forward_pass_leaves_no_hook() -> None:
    lm = _lm("qwen2")
    before = count_forward_hooks(lm.model)
    bad = torch.full((1, 4), 10_000)  # out of the vocabulary: the embedding raises
    with pytest.raises(IndexError), Generation(lm, bad, 1) as gen:
        gen.prefill()
    assert count_forward_hooks(lm.model) == before


def test_stop_ends_decoding() -> None:
    lm = _lm("llama")
    ids = torch.randint(1, 256, (1, 5))
    with Generation(lm, ids, 1, GenerationOptions(max_new_tokens=50, ignore_eos=True)) as gen:
        for n, _ in enumerate(gen.stream(), 1):
            if n == 3:
                gen.stop()
    assert len(gen.new_ids) == 3
    assert gen.finish_reason == "cancelled"


def test_layer_lookup_explains_unsupported_models() -> None:
    with pytest.raises(ModelStructureError, match="model.layers"):
        decoder_layers(torch.nn.Linear(2, 2))
    assert len(decoder_layers(tiny_model("qwen2"))) == 4


def test_detokenizer_never_splits_a_utf8_character() -> None:
    detok = _Detokenizer(ByteTokenizer())
    pieces = [detok.push(b) for b in "é→😀".encode()]
    assert "".join(pieces) == "é→😀"
    assert all("\ufffd" not in p for p in pieces)
    assert pieces[0] == ""  # the first byte of 'é' alone is held back


def test_each_decoding_step_may_run_on_another_thread() -> None:
    """A web server's worker pool advances a streaming generator from whichever
    thread is free; grad mode is thread-local, so inference mode must be entered
    around each forward pass, not once around the whole generation."""
    import threading

    lm = _lm("llama")
    ids = torch.tensor([[5, 6, 7, 8]])
    opts = GenerationOptions(max_new_tokens=6, ignore_eos=True)
    with Generation(lm, ids, 2, opts) as same_thread:
        same_thread.prefill()
        expected = [e.token_id for e in same_thread.stream()]
    with Generation(lm, ids, 2, opts) as gen:
        gen.prefill()
        steps = gen.stream()
        got: list[int] = [next(steps).token_id]  # the first step on the thread that opened it
        errors: list[BaseException] = []

        def one_step() -> None:
            try:
                got.append(next(steps).token_id)
            except StopIteration:
                pass
            except BaseException as exc:  # noqa: BLE001 - reported to the test thread
                errors.append(exc)

        for _ in range(8):
            worker = threading.Thread(target=one_step)  # a fresh thread: grad mode at its default (on)
            worker.start()
            worker.join()
        assert not errors, errors
    assert torch.is_grad_enabled(), "the generation must not leave grad mode changed on this thread"
    assert got == expected
    assert count_forward_hooks(lm.model) == 0


def test_a_second_layer_is_captured_from_the_same_passes() -> None:
    """The safety layer's states come from the turn's own forward passes: equal to
    output_hidden_states at that layer, with one hook more and no extra pass."""
    lm = _lm("llama")
    ids = torch.randint(1, 256, (1, 7), generator=torch.Generator().manual_seed(5))
    with torch.inference_mode():
        ref = lm.model(ids, output_hidden_states=True).hidden_states
    opts = GenerationOptions(max_new_tokens=4, ignore_eos=True)
    before = count_forward_hooks(lm.model)  # transformers keeps hooks of its own after output_hidden_states
    with Generation(lm, ids, 2, opts, also_capture=(3,)) as gen:
        assert count_forward_hooks(lm.model) == before + 2
        h = gen.prefill()
        np.testing.assert_allclose(h, ref[2][0, -1].numpy(), rtol=1e-5, atol=1e-5)
        np.testing.assert_allclose(gen.prompt_state(3), ref[3][0, -1].numpy(), rtol=1e-5, atol=1e-5)
        list(gen.stream())
        assert gen.reply_hidden(3).shape == gen.reply_hidden().shape == (3, lm.hidden_size)
        assert not np.allclose(gen.reply_hidden(3), gen.reply_hidden())
        with pytest.raises(ValueError, match="not captured"):
            gen.reply_hidden(1)
    assert count_forward_hooks(lm.model) == before


def test_the_safety_state_is_the_mean_over_the_message_in_one_pass_or_batched() -> None:
    """The pooled prompt state (mean over the message's tokens) from a turn's own
    prefill equals output_hidden_states averaged over that span, and the batched,
    left-padded calibration path gives the same vector for each prompt."""
    from isagi.engines.hf.generation import prompt_hidden_states

    lm = _lm("llama")
    chats = [[{"role": "system", "content": "be brief"}, {"role": "user", "content": text}]
             for text in ("hi", "how do I kill a python process?", "a much longer message than the others, padded less")]
    a, b = lm.content_span(chats[1])
    ids = lm.chat_ids(chats[1])
    assert bytes(ids[0, a:b].tolist()).decode() == "how do I kill a python process?"
    with torch.inference_mode():
        ref = lm.model(ids, output_hidden_states=True).hidden_states[3][0, a:b].mean(0).numpy()
    with Generation(lm, ids, 2, also_capture=(3,)) as gen:
        gen.prefill()
        pooled = gen.prompt_state(3, span=(a, b))
        last = gen.prompt_state(3)
        main_states = gen.prompt_states(2)  # the main layer keeps the whole prompt too (pooling is above)
    assert main_states.shape == (ids.shape[1], lm.hidden_size)
    with torch.inference_mode():
        ref2 = lm.model(ids, output_hidden_states=True).hidden_states[2][0]
    np.testing.assert_allclose(main_states, ref2.numpy(), rtol=1e-5, atol=1e-5)
    np.testing.assert_allclose(pooled, ref, rtol=1e-5, atol=1e-5)
    assert not np.allclose(pooled, last)
    batched = prompt_hidden_states(lm, chats, 3, pool="content")
    alone = np.concatenate([prompt_hidden_states(lm, [c], 3, pool="content") for c in chats])
    np.testing.assert_allclose(batched, alone, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(batched[1], ref, rtol=1e-4, atol=1e-4)
    with pytest.raises(ValueError, match="pool="):
        prompt_hidden_states(lm, chats, 3, pool="max")
    # The same through the engine seam: per-token states from the engine, pooled above it.
    from isagi.engines.hf.engine import TransformersEngine
    from isagi.manifold.pooling import prompt_hidden_states as pooled_states

    engine = TransformersEngine(lm)
    np.testing.assert_allclose(pooled_states(engine, chats, 3, pool="content", batch_size=2), batched, rtol=1e-4, atol=1e-4)
    np.testing.assert_allclose(pooled_states(engine, chats, 3, batch_size=2), prompt_hidden_states(lm, chats, 3),
                               rtol=1e-4, atol=1e-4)


def test_an_empty_message_is_stood_for_by_the_last_prompt_token() -> None:
    lm = _lm("llama")
    chat = [{"role": "user", "content": ""}]
    n = lm.chat_ids(chat).shape[1]
    assert lm.content_span(chat) == (n - 1, n)
