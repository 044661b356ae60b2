"""A real :class:`~isagi.pipeline.engine.Engine` on a tiny random model, for the fast tests.

The model is a 4-layer Llama of width 64 built from a config (no download,
random weights, output restricted to printable ASCII: its replies are
readable noise that never ends before ``max_new_tokens``), with a byte-level
tokenizer (one token per UTF-8 byte, id 0 ends a reply) and a plain
"role: content" template. The profile is synthetic but has the real shapes and is fitted the
way the real one is, on data that is not the product's: the UGT basis and
the zone centroids are fitted on the tiny model's own states of random byte
strings (so distances between different messages spread as they do on a real
model), the safety profile's forbidden subspace is a random orthonormal
4-dimensional one centred on those states. Thresholds default to 100 % (TEH
never exceeds 100 %, so nothing is refused or withheld); tests that need a
refusal or a withheld reply set them to 0.

Everything downstream is the product's own code: validation, prefill and
capture hooks, projection, the lookup, :func:`isagi.manifold.decide.decide`, decoding
from the KV cache with the reply guard, the metric update, the history store,
the ``.miku`` autosave.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
import torch

from isagi.config import Settings, load_settings
from isagi.engines.hf.engine import TransformersEngine
from isagi.engines.hf.model import LoadedModel
from isagi.manifold.distance_scale import SEED
from isagi.manifold.pooling import prompt_hidden_states
from isagi.manifold.ugt import Zones, fit_basis, project
from isagi.pipeline.engine import Engine
from isagi.profile import Profile
from isagi.safety.runtime import SafetyProfile

CONTEXT = 2048  # the tiny model's context, in byte tokens
LAYER, SAFETY_LAYER, K = 3, 2, 8
SYSTEM = "Be brief."


class ByteTokenizer:
    """One token per UTF-8 byte; id 0 ends a reply; the template writes "role: content" lines."""

    eos_token_id = 0
    unk_token_id = None
    pad_token_id = 0

    def __call__(self, text: str, add_special_tokens: bool = True) -> dict[str, list[int]]:
        return {"input_ids": list(text.encode("utf-8"))}

    def decode(self, ids: list[int], skip_special_tokens: bool = True) -> str:
        return bytes(i for i in ids if i != 0).decode("utf-8", errors="replace")

    def convert_tokens_to_ids(self, token: str) -> None:
        return None

    def apply_chat_template(self, messages: list[dict[str, str]], **_: object) -> dict[str, torch.Tensor]:
        text = "".join(f"{m['role']}: {m['content']}\n" for m in messages) + "assistant:"
        return {"input_ids": torch.tensor([list(text.encode())], dtype=torch.long)}


@functools.cache
def tiny_lm() -> TransformersEngine:
    """The tiny model behind the transformers engine, built once per test process (it is only read)."""
    from tests.conftest import tiny_model

    # Matrices this small run fastest on one thread; on a shared machine, many
    # threads spinning on them make each turn some 30 times slower.
    torch.set_num_threads(1)
    model = tiny_model("llama", seed=0, context=CONTEXT)
    model.generation_config.eos_token_id = 0
    # Replies in printable ASCII (readable in assertions and terminals): the output rows of
    # every other byte are zeroed, so their logit is 0 and a printable byte always wins.
    with torch.no_grad():
        keep = torch.zeros(model.lm_head.weight.shape[0], dtype=torch.bool)
        keep[32:127] = True
        model.lm_head.weight[~keep] = 0.0
    loaded = LoadedModel(model=model, tokenizer=ByteTokenizer(), model_id="tiny/llama-random", source="config",
                         fingerprint="tiny-" + "0" * 59, quant="none", device=torch.device("cpu"),
                         device_reason="test")
    return TransformersEngine(loaded, backend_reason="tests: a tiny random model")


def _random_texts(rng: np.random.Generator, n: int) -> list[str]:
    letters = np.array(list("abcdefghijklmnopqrstuvwxyz     "))
    return ["".join(rng.choice(letters, size=int(rng.integers(8, 40)))) for _ in range(n)]


@functools.cache
def tiny_profile() -> Profile:
    """A synthetic profile of the right shapes, fitted on the tiny model's states of random strings."""
    lm = tiny_lm()
    rng = np.random.default_rng(7)
    chats = [[{"role": "system", "content": SYSTEM}, {"role": "user", "content": t}] for t in _random_texts(rng, 48)]
    H = prompt_hidden_states(lm, chats, LAYER)
    basis = fit_basis(H, K)
    X = project(basis, H)
    zones = Zones(names=["alpha", "beta", "gamma"], centroids=np.stack([X[i::3].mean(0) for i in range(3)]).astype(np.float32))
    # a probe over two layers side by side, as the shipped profiles read several; its bias keeps
    # TEH near 0, so nothing is refused or withheld unless a test sets a threshold
    safety_layers = [1, SAFETY_LAYER]
    H_safety = np.concatenate([prompt_hidden_states(lm, chats, layer) for layer in safety_layers], axis=1)
    d = lm.hidden_size
    Q = np.zeros((2 * d, 2))
    for j, v in enumerate(rng.standard_normal((2, d))):
        Q[j * d:(j + 1) * d, j] = v / np.linalg.norm(v)
    cats = ["violence", "fraud"]
    dirs = rng.standard_normal((len(cats), 2 * d))
    safety = SafetyProfile(
        Q=Q.astype(np.float32), centre=H_safety.mean(0).astype(np.float32), threshold=100.0, reply_threshold=100.0,
        layer=SAFETY_LAYER, layers=safety_layers, weights=np.full(2, 0.01, np.float32), bias=-20.0, categories=cats,
        category_directions=(dirs / np.linalg.norm(dirs, axis=1, keepdims=True)).astype(np.float32),
        category_bias=np.zeros(len(cats), np.float32), roc={}, details={},
        # an exchange reply guard, as the shipped profiles have: replies are read through the probe
        # and judged with their prompt
        reply_Q=np.eye(2, dtype=np.float32), reply_centre=np.zeros(2, np.float32), reply_scales=np.ones(2, np.float32),
        reply_weights=np.full(2, 0.01, np.float32), reply_bias=-20.0, window_threshold=100.0,
    )
    return Profile(key="tiny-profile", model_fingerprint=lm.fingerprint, layer=LAYER, k=int(basis.B.shape[1]),
                   basis=basis, zones=zones, safety=safety, context_threshold=0.0, distance_scale=SEED)


def tiny_settings(home: Path, **overrides: Any) -> Settings:
    # Messages are read alone: reading one in its conversation first relies on a trained model's
    # states of a message staying close to each other whatever came before, which a random model's
    # do not (tests that exercise that reading pass read_in_conversation=True).
    base: dict[str, Any] = {"system_prompt": SYSTEM, "max_new_tokens": 12, "device": "cpu",
                            "read_in_conversation": False}
    base.update(overrides)
    return load_settings(environ={}, home=home, **base)


def tiny_engine(home: Path, *, with_store: bool = True, refuse: bool = False, withhold: bool = False,
                **overrides: Any) -> Engine:
    """A started engine (history store and autosave as ``Engine.start`` sets them up) under ``home``.

    ``refuse`` / ``withhold`` set the prompt / reply TEH threshold to 0, so every
    prompt is refused / every reply withheld at its first check.
    """
    profile = tiny_profile()
    if refuse or withhold:
        import dataclasses

        safety = dataclasses.replace(profile.safety, threshold=0.0 if refuse else 100.0,
                                     reply_threshold=0.0 if withhold else 100.0)
        profile = dataclasses.replace(profile, safety=safety)
    return Engine.start(tiny_settings(home, **overrides), with_store=with_store, lm=tiny_lm(), profile=profile)


def engine_for(settings: Settings, store: Any = None) -> Engine:
    """The tiny model and profile under given ``settings``, persisting to ``store`` (and autosaving)."""
    from isagi.pipeline.keeping import default_keeper

    engine = Engine(settings, tiny_lm(), tiny_profile(), store)
    engine.keep = default_keeper(lambda: engine.frame, store, model_id=engine.lm.model_id)
    return engine
