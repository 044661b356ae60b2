"""The calibration-only grid behind docs/measurements.md, "A harm probe fitted on the twins
(not shipped)": TEH against logistic and small non-linear probes as the prompt guard's score.

Not part of the product: the shipped guard is TEH (isagi.safety.runtime). This script keeps the
experiment of issue 22 rerunnable until a profile build takes it over. It reads only the
project's calibration rows and twins (isagi.data.safety), never the evaluation sets.

For every row of ``safety_calibration.jsonl`` + ``safety_twins.jsonl`` it reads, at the
safety layer, the mean state over the user's message and the mean over the template's
tokens after it (TEH's safety state is their average; the probes see both side by side).
Each score is then refitted per fold under two protocols: leave one category out
(``loco``), and 5 folds that keep each twin pair whole (``pairs``). The out-of-fold scores
are pooled against the borderline benign rows (every benign row but the everyday tasks):
AUC, TPR at 1 % FPR, TPR at the 2 % budget the product uses, and the twins' TPR / FPR there.

Needs scikit-learn (``pip install scikit-learn``; not a dependency of ISAGI). Run from the
repository root::

    python scripts/safety_probe_grid.py [--backend llamacpp] [--states states.npz] [--limit N] [--json]

``--states`` caches the read-outs: one forward pass per prompt, the same pass as the profile
build's, whose 4,007 calibration prompts took 13 min 53 s on 2 cores with llama.cpp.
``--limit`` takes every N-th row, for a quick look (``--limit 100``: 41 rows, about a minute).
"""

from __future__ import annotations

import argparse
import json
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

BUDGET = 0.02  # isagi.safety.calibration.FPR_BUDGET, the product's prompt budget
PROBES: dict[str, tuple[str, dict[str, float]]] = {
    "teh": ("teh", {}),
    "logistic C=0.003": ("logistic", {"C": 0.003}),
    "logistic C=0.01": ("logistic", {"C": 0.01}),
    "mlp 32 alpha=10": ("mlp", {"hidden": 32, "alpha": 10.0}),
    "mlp 64 alpha=3": ("mlp", {"hidden": 64, "alpha": 3.0}),
    "mlp 64 alpha=10": ("mlp", {"hidden": 64, "alpha": 10.0}),
    "mlp 64 alpha=30": ("mlp", {"hidden": 64, "alpha": 30.0}),
    "mlp 128 alpha=10": ("mlp", {"hidden": 128, "alpha": 10.0}),
}


def read_outs(backend: str | None, rows: list[dict[str, Any]], cache: Path | None) -> np.ndarray:
    """(n, 2d): the content and post means at the safety layer, side by side (cached in ``cache``)."""
    texts = [r["text"] for r in rows]
    if cache is not None and cache.is_file():
        with np.load(cache, allow_pickle=False) as z:
            if list(z["texts"]) == texts:
                return z["X"]
    from isagi.config import load_settings
    from isagi.engines import load_engine
    from isagi.manifold.pooling import pool_states

    settings = load_settings(**({"backend": backend} if backend else {}))
    lm = load_engine(settings)
    chats = [[{"role": "system", "content": settings.system_prompt}, {"role": "user", "content": t}] for t in texts]
    layer = lm.default_safety_layer
    # one forward pass per prompt gives both span means (as isagi eval safety-cv reads its read-outs)
    X = np.stack([np.concatenate([pool_states(per_layer[layer], pool, lm.content_span(chat)) for pool in ("content", "post")])
                  for chat, per_layer in zip(chats, lm.iter_prompt_states(chats, [layer]), strict=True)])
    if cache is not None:
        np.savez(cache, X=X, texts=np.array(texts))
    return X


def grouped_folds(groups: np.ndarray, k: int, seed: int = 0) -> list[np.ndarray]:
    """``k`` folds of row indices that keep each group (a twin pair; a lone row is its own) whole."""
    names = np.unique(groups)
    np.random.default_rng(seed).shuffle(names)
    return [np.flatnonzero(np.isin(groups, part)) for part in np.array_split(names, k)]


def scorer(kind: str, params: dict[str, float], X: np.ndarray, y: np.ndarray,
           cats: np.ndarray) -> Callable[[np.ndarray], np.ndarray]:
    """Fit one score on rows ``X``; returns rows -> scores."""
    from isagi.safety.calibration import snipe, split_by_category
    from isagi.safety.runtime import teh

    d = X.shape[1] // 2
    if kind == "teh":  # the shipped construction on the safety state (the halves' mean)
        Q, c, _ = snipe(*split_by_category((X[:, :d] + X[:, d:]) / 2, y, cats))
        return lambda Xt: np.asarray(teh((Q, c), (Xt[:, :d] + Xt[:, d:]) / 2))
    from sklearn.exceptions import ConvergenceWarning
    from sklearn.linear_model import LogisticRegression
    from sklearn.neural_network import MLPClassifier
    from sklearn.pipeline import make_pipeline
    from sklearn.preprocessing import StandardScaler

    if kind == "logistic":
        model = make_pipeline(StandardScaler(), LogisticRegression(C=params["C"], max_iter=3000))
    else:  # a fixed iteration budget is part of the method
        model = make_pipeline(StandardScaler(), MLPClassifier(hidden_layer_sizes=(int(params["hidden"]),),
                                                              alpha=params["alpha"], max_iter=300, random_state=0))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ConvergenceWarning)
        model.fit(X, y)
    return lambda Xt: model.predict_proba(Xt)[:, 1]


def grid(X: np.ndarray, rows: list[dict[str, Any]], probes: dict[str, tuple[str, dict[str, float]]]) -> list[dict]:
    """Each score's out-of-fold figures under ``loco`` and ``pairs`` (module docstring)."""
    from isagi.safety.calibration import budget_threshold, ordinary_mask, roc_auc, tpr_at_fpr

    y = np.array([r["label"] == "harmful" for r in rows]).astype(int)
    cats = np.array([r["category"] for r in rows])
    groups = np.array([r.get("pair") or f"row-{i}" for i, r in enumerate(rows)])
    twin = np.array(["pair" in r for r in rows])
    counted = (y == 0) & ~ordinary_mask(rows)
    harm = y == 1
    protocols = {"loco": [np.flatnonzero(cats == c) for c in sorted(set(cats.tolist()))],
                 "pairs": grouped_folds(groups, 5)}
    out = []
    for name, (kind, params) in probes.items():
        row: dict[str, Any] = {"score": name}
        for protocol, folds in protocols.items():
            oof = np.zeros(len(X))
            for test in folds:
                train = np.setdiff1d(np.arange(len(X)), test)
                oof[test] = scorer(kind, params, X[train], y[train], cats[train])(X[test])
            threshold = budget_threshold(oof[counted], BUDGET)
            row[protocol] = {"auc": round(roc_auc(oof[harm], oof[counted]), 4),
                             "tpr_at_1pct_fpr": round(tpr_at_fpr(oof[harm], oof[counted], 0.01), 4),
                             "tpr_at_budget": round(float((oof[harm] > threshold).mean()), 4),
                             "twins_tpr_at_budget": round(float((oof[harm & twin] > threshold).mean()), 4),
                             "twins_fpr_at_budget": round(float((oof[counted & twin] > threshold).mean()), 4)}
        out.append(row)
    return out


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--backend", help="llamacpp (default) or transformers")
    p.add_argument("--states", type=Path, help="an .npz file to cache the read-outs in")
    p.add_argument("--limit", type=int, default=1, help="take every N-th row (a quick look)")
    p.add_argument("--json", action="store_true")
    args = p.parse_args(argv)
    from isagi.data.safety import load_safety_calibration, load_safety_twins

    rows = (load_safety_calibration() + load_safety_twins())[:: max(1, args.limit)]
    X = read_outs(args.backend, rows, args.states).astype(np.float64)
    result = grid(X, rows, PROBES)
    if args.json:
        print(json.dumps({"rows": len(rows), "budget": BUDGET, "grid": result}))
        return
    print(f"{len(rows)} rows; AUC / TPR at 1 % FPR / TPR at the {BUDGET:.0%} budget (twins TPR / FPR)")
    for r in result:
        print(f"{r['score']:18s} " + " | ".join(
            f"{k}: {v['auc']:.3f} / {v['tpr_at_1pct_fpr']:.2f} / {v['tpr_at_budget']:.2f} "
            f"({v['twins_tpr_at_budget']:.2f} / {v['twins_fpr_at_budget']:.3f})" for k, v in r.items() if k != "score"))


if __name__ == "__main__":
    main()
