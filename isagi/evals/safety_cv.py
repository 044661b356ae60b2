"""``isagi eval safety-cv``: the calibration-only choice of the safety state and its hyper-parameters.

Owns the evidence behind the shipped defaults (``default_safety_layer``,
``SAFETY_POOL``, ``DEFAULT_SHRINKAGE``, ``DEFAULT_OFFSET`` in
:mod:`isagi.safety`). It reads only the project's calibration set, never the
evaluation sets: for every combination of pooling (``last`` token or the
``content`` mean over the message), layer, shrinkage and centre offset it
reports leave-one-category-out CV (held-out AUC, and TPR/FPR at the training
rows' zero-FP threshold) and 5-fold CV AUC. ``best`` is the row with the
highest leave-one-category-out AUC, ties broken by the 5-fold AUC: the rule
the defaults were chosen by.
"""

from __future__ import annotations

from itertools import product
from typing import Any

import numpy as np

from isagi.safety import cross_validate, leave_one_category_out


def grid(
    states: dict[tuple[str, int], np.ndarray],
    labels: np.ndarray,
    cats: np.ndarray,
    *,
    shrinkages: list[float],
    offsets: list[float],
) -> dict[str, Any]:
    """CV rows for every (pool, layer) in ``states`` × shrinkage × offset, and the best row."""
    rows = []
    for (pool, layer), shrinkage, offset in product(sorted(states), shrinkages, offsets):
        H = np.asarray(states[(pool, layer)], dtype=np.float64)
        params = {"shrinkage": shrinkage, "offset": offset}
        loco = leave_one_category_out(H, labels, cats, **params)
        kfold = cross_validate(H, labels, cats, **params)
        rows.append({"pool": pool, "layer": layer, "shrinkage": shrinkage, "offset": offset,
                     "loco_auc": round(loco["auc"], 4), "loco_tpr": round(loco["tpr"], 4),
                     "loco_fpr": round(loco["fpr"], 4), "kfold_auc": round(kfold["auc"], 4)})
    best = max(rows, key=lambda r: (r["loco_auc"], r["kfold_auc"])) if rows else None
    return {"rows": rows, "best": best}


def run(lm: Any, *, system_prompt: str, layers: list[int], pools: list[str], shrinkages: list[float],
        offsets: list[float], progress: Any = None) -> dict[str, Any]:
    """Calibration states at ``layers`` (one forward pass per batch and pooling), then :func:`grid`."""
    from isagi.data.safety import load_safety_calibration
    from isagi.pooling import prompt_hidden_states_at
    from isagi.safety import _chat

    rows = load_safety_calibration()
    chats = [_chat(system_prompt, r["text"]) for r in rows]
    labels = np.array([1 if r["label"] == "harmful" else 0 for r in rows])
    cats = np.array([r["category"] for r in rows])
    states: dict[tuple[str, int], np.ndarray] = {}
    for pool in pools:
        for layer, H in prompt_hidden_states_at(lm, chats, layers, pool=pool, progress=progress).items():
            states[(pool, layer)] = H
    out = grid(states, labels, cats, shrinkages=shrinkages, offsets=offsets)
    out["n_calibration"] = int(len(rows))
    return out
