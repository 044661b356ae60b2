"""``isagi eval safety-cv``: the calibration-only choice of the safety state and its hyper-parameters.

Owns the evidence behind the shipped defaults (``default_safety_layer``,
``SAFETY_POOL``, ``DEFAULT_SHRINKAGE``, ``DEFAULT_OFFSET`` and ``FPR_BUDGET``
in :mod:`isagi.safety`). It reads only the project's calibration set, never
the evaluation sets.

A *read-out* is where the prompt's state is read (:mod:`isagi.pooling`):
``last`` token, ``content`` mean over the message, ``post`` mean over the
post-instruction tokens, ``content+post`` (the average of those two means),
each at one layer; ``concat`` joins one read-out at several layers into one
longer vector (``--concat 15,18,21``); ``framed`` is the prompted read-out:
the message wrapped in a short "is this request harmful?" frame
(:data:`FRAME`), read at its last token, one more prefill per turn.

For every read-out × shrinkage × centre offset the grid reports
leave-one-category-out CV (train on seven categories, test on the eighth:
mean held-out AUC, pooled AUC, TPR at 1 % and 5 % FPR, and TPR/FPR at the
training rows' threshold for the FPR budget) and the same for 5-fold CV.
``best`` is the row with the highest leave-one-category-out AUC, ties broken
by the 5-fold AUC, among the read-outs the product can use as its safety
state: one vector of the residual stream at one layer, because the reply
guard and Safe OGD's projector act there. Concatenations are measured and
reported beside (``best_any``).
"""

from __future__ import annotations

from collections.abc import Callable
from itertools import product
from typing import Any

import numpy as np

from isagi.progress import counter
from isagi.safety import FPR_BUDGET, cross_validate, leave_one_category_out

FRAME = "Is the following request harmful? Answer yes or no.\n\nRequest: {text}"


def grid(
    states: dict[tuple[str, Any], np.ndarray],
    labels: np.ndarray,
    cats: np.ndarray,
    *,
    shrinkages: list[float],
    offsets: list[float],
    budget: float = FPR_BUDGET,
) -> dict[str, Any]:
    """CV rows for every (read-out, layer) in ``states`` × shrinkage × offset, and the best rows.

    A key's layer is an ``int`` for a one-layer read-out and a ``str`` such as
    ``"15+18+21"`` for a concatenation (not eligible for ``best``).
    """
    rows = []
    for (pool, layer), shrinkage, offset in product(sorted(states, key=str), shrinkages, offsets):
        H = np.asarray(states[(pool, layer)], dtype=np.float64)
        params = {"shrinkage": shrinkage, "offset": offset, "budget": budget}
        loco = leave_one_category_out(H, labels, cats, **params)
        kfold = cross_validate(H, labels, cats, **params)
        rows.append({"pool": pool, "layer": layer, "shrinkage": shrinkage, "offset": offset,
                     "loco_auc": round(loco["auc"], 4), "loco_pooled_auc": round(loco["pooled_auc"], 4),
                     "loco_tpr_at_1pct_fpr": round(loco["tpr_at_1pct_fpr"], 4),
                     "loco_tpr_at_5pct_fpr": round(loco["tpr_at_5pct_fpr"], 4),
                     "loco_tpr": round(loco["tpr"], 4), "loco_fpr": round(loco["fpr"], 4),
                     "kfold_auc": round(kfold["auc"], 4),
                     "kfold_tpr_at_1pct_fpr": round(kfold["tpr_at_1pct_fpr"], 4),
                     "kfold_tpr_at_5pct_fpr": round(kfold["tpr_at_5pct_fpr"], 4),
                     "kfold_tpr": round(kfold["tpr"], 4), "kfold_fpr": round(kfold["fpr"], 4)})

    def rank(r: dict[str, Any]) -> tuple[float, float]:
        return r["loco_auc"], r["kfold_auc"]

    usable = [r for r in rows if isinstance(r["layer"], int)]
    return {"rows": rows, "best": max(usable, key=rank) if usable else None,
            "best_any": max(rows, key=rank) if rows else None, "budget": budget}


def run(lm: Any, *, system_prompt: str, layers: list[int], pools: list[str], shrinkages: list[float],
        offsets: list[float], concat: list[list[int]] | None = None, framed: bool = False,
        budget: float = FPR_BUDGET, progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Calibration states at ``layers`` (one forward pass per prompt gives every read-out), then :func:`grid`;
    ``progress(stage, done, total)`` as the prompts go through the model."""
    from isagi.data.safety import load_safety_calibration
    from isagi.pooling import pool_states, prompt_hidden_states_at
    from isagi.safety import _chat

    rows = load_safety_calibration()
    labels = np.array([1 if r["label"] == "harmful" else 0 for r in rows])
    cats = np.array([r["category"] for r in rows])
    wanted = sorted({*layers, *(layer for group in concat or [] for layer in group)})
    chats = [_chat(system_prompt, r["text"]) for r in rows]
    pooled: dict[tuple[str, int], list[np.ndarray]] = {(p, la): [] for p in pools for la in wanted}
    states_of = lm.iter_prompt_states(chats, wanted, progress=counter(progress, "Calibration prompts", len(chats)))
    for chat, per_layer in zip(chats, states_of, strict=True):
        span = lm.content_span(chat)
        for pool, layer in pooled:
            pooled[(pool, layer)].append(pool_states(per_layer[layer], pool, span if pool != "last" else None))
    arrays = {key: np.stack(v) for key, v in pooled.items()}
    states: dict[tuple[str, Any], np.ndarray] = {k: v for k, v in arrays.items() if k[1] in layers}
    for pool, group in product(pools, concat or []):
        # each layer's block scaled to unit mean norm, so no layer dominates by its scale
        blocks = [arrays[(pool, la)] / np.linalg.norm(arrays[(pool, la)], axis=1).mean() for la in group]
        states[(pool, "+".join(map(str, group)))] = np.concatenate(blocks, axis=1)
    if framed:
        framed_chats = [_chat(system_prompt, FRAME.format(text=r["text"])) for r in rows]
        tick = counter(progress, "Calibration prompts in the harmfulness frame", len(framed_chats))
        for layer, H in prompt_hidden_states_at(lm, framed_chats, layers, pool="last", progress=tick).items():
            states[("framed", layer)] = H
    out = grid(states, labels, cats, shrinkages=shrinkages, offsets=offsets, budget=budget)
    out["n_calibration"] = int(len(rows))
    return out

