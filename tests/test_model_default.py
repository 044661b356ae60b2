"""The real default model (SmolLM2-135M-Instruct in NF4), loaded once per test session."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from isagi.engines.hf.generation import Generation, GenerationOptions, prompt_hidden_states
from isagi.engines.hf.hooks import count_forward_hooks

pytestmark = pytest.mark.model


def _chat(lm, text: str) -> torch.Tensor:
    return lm.chat_ids([{"role": "user", "content": text}])


def test_default_model_is_nf4_and_answers_paris(default_lm) -> None:
    import bitsandbytes as bnb

    assert any(isinstance(m, bnb.nn.Linear4bit) for m in default_lm.model.modules())
    assert default_lm.quant == "nf4"
    with Generation(default_lm, _chat(default_lm, "What is the capital of France?"), default_lm.default_layer,
                    GenerationOptions(max_new_tokens=32)) as gen:
        gen.prefill()
        reply = "".join(e.text for e in gen.stream())
    assert "Paris" in reply


def test_captured_h_matches_output_hidden_states(default_lm) -> None:
    """Tolerance: exact in float32 arithmetic; 1e-4 relative allows for kernel order."""
    layer = default_lm.default_layer
    ids = _chat(default_lm, "Name three primary colours.")
    with Generation(default_lm, ids, layer) as gen:
        h = gen.prefill()
    with torch.inference_mode():
        ref = default_lm.model(input_ids=ids, output_hidden_states=True).hidden_states[layer][0, -1]
    ref = ref.float().numpy()
    assert np.linalg.norm(h - ref) <= 1e-4 * np.linalg.norm(ref)
    batched = prompt_hidden_states(default_lm, [[{"role": "user", "content": "hi"}],
                                                [{"role": "user", "content": "Name three primary colours."}]], layer)
    assert np.linalg.norm(batched[1] - ref) <= 1e-3 * np.linalg.norm(ref)


def test_hooks_are_gone_after_a_turn_that_raised(default_lm) -> None:
    before = count_forward_hooks(default_lm.model)
    with pytest.raises(KeyboardInterrupt), Generation(default_lm, _chat(default_lm, "Count to ten."),
                                                      default_lm.default_layer) as gen:
        for _ in gen.stream():
            raise KeyboardInterrupt
    assert count_forward_hooks(default_lm.model) == before


def test_content_span_is_the_last_message_in_the_real_template(default_lm) -> None:
    """The safety state pools exactly the user's words: not the system prompt,
    an earlier turn or the template tokens around the message."""
    chat = [{"role": "system", "content": "You are helpful."},
            {"role": "user", "content": "What is 2+2?"},
            {"role": "assistant", "content": "4."},
            {"role": "user", "content": "How do I kill a Python process?"}]
    for messages in (chat[:2], chat):
        a, b = default_lm.content_span(messages)
        ids = default_lm.chat_ids(messages)[0]
        assert default_lm.tokenizer.decode(ids[a:b]) == messages[-1]["content"]
        assert b < len(ids)  # the template's "assistant" header follows the message
