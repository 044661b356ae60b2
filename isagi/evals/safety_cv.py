"""``isagi eval safety-cv``: the calibration-only choice of the safety state and its hyper-parameters.

Owns the evidence behind the shipped defaults (``default_safety_layer``,
``SAFETY_POOL``, ``DEFAULT_SHRINKAGE``, ``DEFAULT_OFFSET`` and ``FPR_BUDGET``
in :mod:`isagi.safety.calibration`). It reads only the project's calibration set, never
the evaluation sets.

A *read-out* is where the prompt's state is read (:mod:`isagi.manifold.pooling`):
``last`` token, ``content`` mean over the message, ``post`` mean over the
post-instruction tokens, ``content+post`` (the average of those two means),
each at one layer; ``concat`` joins one read-out at several layers into one
longer vector (``--concat 15,18,21``); ``framed`` is the prompted read-out:
the message wrapped in a short "is this request harmful?" frame
(:data:`FRAME`), read at its last token, one more prefill per turn.

A *data* choice is which calibration rows take part (:data:`DATA`): ``all``;
``no-ordinary``, without the everyday instruction tasks (``kind``
``ordinary_task``); ``original``, the rows written before issue 13 (no
``kind``). The figures are always against the borderline benign rows of the
subset; the everyday tasks, fitted on, are reported apart (``ordinary_fpr``).

For every data × read-out × shrinkage × centre offset the grid reports
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

from isagi.console.progress import counter
from isagi.data.safety import is_ordinary
from isagi.safety.calibration import (
    FPR_BUDGET,
    cross_validate,
    leave_one_category_out,
    ordinary_mask,
)

FRAME = "Is the following request harmful? Answer yes or no.\n\nRequest: {text}"
DATA: dict[str, Callable[[dict[str, Any]], bool]] = {
    "all": lambda row: True,
    "no-ordinary": lambda row: not is_ordinary(row),
    "original": lambda row: "kind" not in row,
}


def grid(
    states: dict[tuple[str, Any], np.ndarray],
    labels: np.ndarray,
    cats: np.ndarray,
    *,
    shrinkages: list[float],
    offsets: list[float],
    budget: float = FPR_BUDGET,
    ordinary: np.ndarray | None = None,
    subsets: dict[str, np.ndarray] | None = None,
) -> dict[str, Any]:
    """CV rows for every data subset × (read-out, layer) in ``states`` × shrinkage × offset, and the best rows.

    A key's layer is an ``int`` for a one-layer read-out and a ``str`` such as
    ``"15+18+21"`` for a concatenation (not eligible for ``best``). ``subsets``
    maps a data choice to the rows it keeps (default: every row, as ``all``);
    ``ordinary`` marks the everyday tasks (outside the budget and the figures).
    """
    subsets = subsets or {"all": np.ones(len(labels), dtype=bool)}
    ordinary = np.zeros(len(labels), dtype=bool) if ordinary is None else np.asarray(ordinary, dtype=bool)
    rows = []
    for data, (pool, layer), shrinkage, offset in product(subsets, sorted(states, key=str), shrinkages, offsets):
        keep = subsets[data]
        H = np.asarray(states[(pool, layer)], dtype=np.float64)[keep]
        y, c, o = labels[keep], cats[keep], ordinary[keep]
        params = {"shrinkage": shrinkage, "offset": offset, "budget": budget, "ordinary": o}
        loco = leave_one_category_out(H, y, c, **params)
        kfold = cross_validate(H, y, c, **params)
        extra = ({"loco_ordinary_fpr": round(loco["ordinary_fpr"], 4), "kfold_ordinary_fpr": round(kfold["ordinary_fpr"], 4)}
                 if o.any() else {})
        rows.append({"data": data, "n": int(keep.sum()), "pool": pool, "layer": layer, "shrinkage": shrinkage,
                     "offset": offset, **extra,
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

    # best among the full data: a subset's figures are on fewer (and easier or harder) rows
    first = next(iter(subsets))
    usable = [r for r in rows if isinstance(r["layer"], int) and r["data"] == first]
    return {"rows": rows, "best": max(usable, key=rank) if usable else None,
            "best_any": max((r for r in rows if r["data"] == first), key=rank) if rows else None, "budget": budget}


def run(lm: Any, *, system_prompt: str, layers: list[int], pools: list[str], shrinkages: list[float],
        offsets: list[float], concat: list[list[int]] | None = None, framed: bool = False,
        budget: float = FPR_BUDGET, data: list[str] | None = None,
        progress: Callable[[str, int, int], None] | None = None) -> dict[str, Any]:
    """Calibration states at ``layers`` (one forward pass per prompt gives every read-out), then :func:`grid`
    over the ``data`` choices (:data:`DATA`; default ``all``); ``progress(stage, done, total)`` as the
    prompts go through the model."""
    from isagi.data.safety import load_safety_calibration
    from isagi.manifold.pooling import pool_states, prompt_hidden_states_at
    from isagi.safety.calibration import _chat

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
    subsets = {name: np.array([DATA[name](r) for r in rows], dtype=bool) for name in data or ["all"]}
    out = grid(states, labels, cats, shrinkages=shrinkages, offsets=offsets, budget=budget,
               ordinary=ordinary_mask(rows), subsets=subsets)
    out["n_calibration"] = int(len(rows))
    return out

