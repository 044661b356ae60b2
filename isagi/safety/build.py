"""Building the safety profile, offline (``isagi profile build``): the prompt probe over several
layers, its threshold, the reply guard fitted on the model's own replies, Safe OGD's window check.

Owns the order of the build and what each part is fitted on; the probe's fitting, folds and
threshold rule are :mod:`isagi.safety.probe`, what a turn measures is :mod:`isagi.safety.runtime`.

1. **The prompt guard.** Every row of the calibration corpus
   (:func:`isagi.data.safety.load_safety_corpus`: the project's rows, the twins and the public
   corpora) is read at each layer of ``layers`` (the ``content+post`` read-out,
   :mod:`isagi.manifold.pooling`), the layers side by side. The probe
   (:data:`isagi.safety.probe.DEFAULT_PROBE`: ten small ReLU networks, averaged) is fitted on
   them; its threshold is set on *out-of-fold* logits (5 folds that keep each twin
   pair whole) by the two-budget rule (:func:`isagi.safety.probe.two_budget_threshold`).
2. **The reply guard.** The model's own greedy replies (prompt guard off) to a fixed sample of
   the corpus, harmful and benign of every source. The prompt probe reads each reply's windows
   at the read-out layers; a two-input logistic head judges each *exchange state* (that logit
   beside the probe's out-of-fold logit of the prompt,
   :func:`isagi.safety.runtime.exchange_states`) at the streaming guard's check points; a
   reply's score is its largest check point. Its threshold keeps out-of-fold scores within two
   budgets, one over the replies to ordinary requests and one over the replies to look-alikes
   (``REPLY_ORDINARY_BUDGET``, ``REPLY_LOOKALIKE_BUDGET``): the false alarms all fall on
   look-alikes, so one budget over all benign replies lets twice its share of them go.
3. **Safe OGD's window check** (:func:`isagi.safety.runtime.window_threshold`): the paper's
   share of norm of reply windows in the forbidden directions at the profile's layer, above
   every benign reply's check point by ``REPLY_MARGIN``.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from isagi.safety.calibration import REPLY_MARGIN, roc_auc, roc_sweep, thin_roc
from isagi.safety.probe import (
    DEFAULT_C,
    DEFAULT_PROBE,
    LOOKALIKE_BUDGET,
    ORDINARY_BUDGET,
    BenignKinds,
    ProbeSpec,
    fit_readout,
    group_folds,
    logit_to_teh,
    out_of_fold,
    two_budget_threshold,
)
from isagi.safety.runtime import (
    SAFETY_POOL,
    Readout,
    SafetyProfile,
    exchange_states,
    reply_window_scores,
)

Progress = Callable[[str, int, int], None]

# The read-out layers, as shares of the model's depth, beside its safety layer (the last of them,
# where the reply guard reads replies and Safe OGD steers). Chosen with the probe on its 5-fold
# figures (docs/measurements.md, "The MLP probe"), among sets that read nothing past the safety
# layer: a step added at the safety layer cannot reach an earlier layer's state, so projecting it
# out of the probe's directions at that layer keeps every reading unchanged.
READ_DEPTHS: tuple[float, ...] = (0.2, 0.4)
REPLY_CALIBRATION_TOKENS = 64  # the replies the reply guard is fitted on are this long
# replies per corpus source and kind the reply guard is fitted on (harmful, and benign replies to
# look-alikes and to ordinary requests): its head has three parameters, so few harmful ones; most
# are look-alikes, where its threshold is decided (a 1 % budget over their scores: no reply to an
# ordinary request has been over it out of fold in any build since the two budgets,
# docs/measurements.md, "The thresholds keep their budgets on new rows")
REPLIES_PER_SOURCE = {"harmful": 24, "lookalike": 84, "ordinary": 28}
# shares of the replies to ordinary requests and to look-alikes (out of fold) the reply guard may
# withhold: product choices, stated, not fitted, each half the product's target of 2 in 100 benign
# replies withheld, for the shift from calibration replies to what people ask (docs/measurements.md,
# "The reply guard's two budgets")
REPLY_ORDINARY_BUDGET = 0.01
REPLY_LOOKALIKE_BUDGET = 0.01


def read_layers(num_layers: int, safety_layer: int) -> list[int]:
    """The layers the safety state is read at: :data:`READ_DEPTHS` of the model's depth, then ``safety_layer``."""
    extra = sorted({max(1, min(num_layers - 1, round(f * num_layers))) for f in READ_DEPTHS} - {safety_layer})
    return [*extra, int(safety_layer)]


def chat(system_prompt: str, text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": text}]


def safety_states(lm: Any, chats: list[list[dict[str, str]]], layers: Sequence[int], *,
                  progress: Callable[[int], None] | None = None) -> np.ndarray:
    """The safety state (n, len(layers)·d) of each chat: the read-out at each layer, side by side."""
    from isagi.manifold.pooling import prompt_hidden_states_at

    per_layer = prompt_hidden_states_at(lm, chats, list(layers), pool=SAFETY_POOL, progress=progress)
    return np.concatenate([per_layer[layer] for layer in layers], axis=1)


@dataclass
class Corpus:
    """The calibration rows' safety states and what the fit reads of each row."""

    X: np.ndarray  # (n, D) safety states
    labels: np.ndarray  # 1 harmful / 0 benign
    cats: np.ndarray
    groups: list[str]  # rows that share a fold (twin pairs)
    sources: np.ndarray  # project, harmbench, twins, catqa, harmfulqa, coconot
    kinds: BenignKinds

    @classmethod
    def of(cls, X: np.ndarray, rows: Sequence[dict[str, Any]]) -> Corpus:
        kind = np.array([r["benign_kind"] or "" for r in rows])
        return cls(X=np.asarray(X, np.float64), labels=np.array([int(r["label"] == "harmful") for r in rows]),
                   cats=np.array([r["category"] for r in rows]), groups=[r["group"] for r in rows],
                   sources=np.array([r["source_group"] for r in rows]),
                   kinds=BenignKinds(ordinary=kind == "ordinary", lookalike=kind == "lookalike"))


def category_probes(X: np.ndarray, labels: np.ndarray, cats: np.ndarray) -> tuple[list[str], np.ndarray, np.ndarray]:
    """(categories, unit directions (c, D), offsets (c,)) naming a refused request's category:
    each category's harmful mean minus the benign mean, offset so its own harmful mean scores 0."""
    benign = X[labels == 0].mean(axis=0)
    names = sorted({str(c) for c in cats[labels == 1]})
    dirs, bias = [], []
    for c in names:
        mean = X[(labels == 1) & (cats == c)].mean(axis=0)
        d = mean - benign
        d = d / max(float(np.linalg.norm(d)), 1e-12)
        dirs.append(d)
        bias.append(-float(d @ mean))
    return names, np.stack(dirs), np.array(bias)


def prompt_report(corpus: Corpus, oof: np.ndarray, threshold: float) -> dict[str, Any]:
    """Out-of-fold figures at ``threshold`` (logits): AUC, the share of each source's and each
    category's rows on the right side of it (harmful above, benign below)."""
    y, harm = corpus.labels, corpus.labels == 1
    right = np.where(harm, oof > threshold, oof <= threshold)
    by_source = {str(s): {"n": int((corpus.sources == s).sum()),
                          "right": round(float(right[corpus.sources == s].mean()), 4)}
                 for s in sorted(set(corpus.sources.tolist()))}
    by_cat = {}
    for c in sorted(set(corpus.cats.tolist())):
        m = corpus.cats == c
        by_cat[str(c)] = {"harmful_flagged": round(float(right[m & harm].mean()), 4) if (m & harm).any() else None,
                          "benign_passed": round(float(right[m & ~harm].mean()), 4) if (m & ~harm).any() else None}
    return {"oof_auc": roc_auc(oof[y == 1], oof[y == 0]),
            "oof_tpr_at_threshold": float((oof[harm] > threshold).mean()),
            "oof_ordinary_fpr_at_threshold": float((oof[corpus.kinds.ordinary] > threshold).mean()),
            "oof_lookalike_fpr_at_threshold": float((oof[corpus.kinds.lookalike] > threshold).mean()),
            "by_source": by_source, "by_category": by_cat}


@dataclass
class Exchanges:
    """The model's replies to a set of calibration prompts: their states at the prompt probe's
    read-out layers (side by side), the prompt probe's *out-of-fold* logit of each prompt (what
    it says of a prompt it never saw, as at run time), labels and categories."""

    reply_states: list[np.ndarray]
    prompt_logits: np.ndarray
    labels: np.ndarray  # 1: a reply to a harmful prompt
    cats: np.ndarray
    kinds: BenignKinds  # which replies answer ordinary requests and which look-alikes


def fit_reply_guard(ex: Exchanges, probe: Readout, *, ordinary_budget: float = REPLY_ORDINARY_BUDGET,
                    lookalike_budget: float = REPLY_LOOKALIKE_BUDGET, k: int = 5, seed: int = 0,
                    C: float = DEFAULT_C) -> tuple[Readout, np.ndarray, float, dict[str, Any]]:
    """The reply head, its scales and its threshold (logit): the lowest that withholds at most
    ``ordinary_budget`` of the replies to ordinary requests and ``lookalike_budget`` of those to
    look-alikes, out of fold.

    ``probe``: the prompt probe, which reads each reply window (:func:`exchange_states`).
    Every check point of a reply is a row, weighted so each reply counts once; a reply's
    score is its largest check point, as the streaming guard withholds it at the first one over.
    """
    z = np.asarray(ex.prompt_logits, dtype=np.float64)
    raw = [exchange_states(probe, r, float(zi), np.ones(2)) for r, zi in zip(ex.reply_states, z, strict=True)]
    read = np.concatenate([x[:, 0] for x in raw if len(x)])
    scales = np.array([float(np.abs(read).mean()) or 1.0, float(np.abs(z).mean()) or 1.0])
    X = [x / scales for x in raw]
    y = np.asarray(ex.labels)

    def fit(ids: np.ndarray) -> Readout:
        keep = [i for i in ids if len(X[i])]
        rows = np.concatenate([X[i] for i in keep])
        ry = np.concatenate([[y[i]] * len(X[i]) for i in keep])
        weight = np.concatenate([[1.0 / len(X[i])] * len(X[i]) for i in keep])
        return fit_readout(rows, ry, [1, 1], C=C, sample_weight=weight * len(keep) / weight.sum())

    def score(readout: Readout, i: int) -> float:
        return float(readout.logits(X[i]).max()) if len(X[i]) else -np.inf

    oof = np.zeros(len(X))
    for test in group_folds([str(i) for i in range(len(X))], k, seed):
        readout = fit(np.setdiff1d(np.arange(len(X)), test))
        oof[test] = [score(readout, i) for i in test]
    threshold, cost = two_budget_threshold(oof, ex.kinds, ordinary_budget=ordinary_budget,
                                           lookalike_budget=lookalike_budget)
    readout = fit(np.arange(len(X)))
    details = {"calibrated": True, "kind": "exchange head",
               "threshold_rule": {"ordinary_budget": ordinary_budget, "lookalike_budget": lookalike_budget, **cost},
               "n_harmful_replies": int((y == 1).sum()), "n_benign_replies": int((y == 0).sum()),
               "oof_auc": roc_auc(oof[y == 1], oof[y == 0]),
               "oof_withheld_harmful": float((oof[y == 1] > threshold).mean()),
               "oof_withheld_benign": float((oof[y == 0] > threshold).mean())}
    return readout, scales, threshold, details


def fit_safety_profile(corpus: Corpus, layers: Sequence[int], *,
                       replies: tuple[np.ndarray, list[np.ndarray]] | None = None,
                       spec: ProbeSpec = DEFAULT_PROBE, C: float = DEFAULT_C, ordinary_budget: float = ORDINARY_BUDGET,
                       lookalike_budget: float = LOOKALIKE_BUDGET, progress: Progress | None = None) -> SafetyProfile:
    """Fit the prompt probe ``spec`` on calibration states and, given ``replies`` (corpus rows and
    the states of the model's replies to them, :func:`generate_reply_states`), the reply guard's
    head, logistic at strength ``C``."""
    stage = "Safety: fitting the guards (cross-validated)"

    def step(done: int) -> None:
        if progress:
            progress(stage, done, 3)

    step(0)
    layers = [int(x) for x in layers]
    d = corpus.X.shape[1] // len(layers)
    blocks = [d] * len(layers)
    folds = group_folds(corpus.groups)
    oof = out_of_fold(corpus.X, corpus.labels, blocks, folds, spec=spec)
    step(1)
    threshold_logit, cost = two_budget_threshold(oof, corpus.kinds, ordinary_budget=ordinary_budget,
                                                 lookalike_budget=lookalike_budget)
    readout = fit_readout(corpus.X, corpus.labels, blocks, spec=spec)
    y = corpus.labels
    oof_teh = 100.0 / (1.0 + np.exp(-np.clip(oof, -60, 60)))
    threshold = logit_to_teh(threshold_logit)
    roc = roc_sweep(oof_teh[y == 1], oof_teh[y == 0])
    roc.update({"threshold": threshold, "tpr_at_threshold": float((oof_teh[y == 1] > threshold).mean()),
                "fpr_at_threshold": float((oof_teh[y == 0] > threshold).mean()), "out_of_fold": True})
    names, dirs, bias = category_probes(corpus.X, y, corpus.cats)
    step(2)
    reply: dict[str, Any] = {"reply_threshold": threshold}
    reply_det: dict[str, Any] = {"calibrated": False}
    profile = SafetyProfile(
        Q=readout.Q.astype(np.float32), centre=readout.centre.astype(np.float32), threshold=threshold,
        reply_threshold=threshold, layer=layers[-1], layers=layers,
        weights=readout.weights.astype(np.float32), bias=float(readout.bias), categories=names,
        hidden=None if readout.hidden is None else readout.hidden.astype(np.float32),
        hidden_bias=None if readout.hidden_bias is None else readout.hidden_bias.astype(np.float32),
        category_directions=dirs.astype(np.float32), category_bias=bias.astype(np.float32),
        roc=thin_roc({k: roc[k] for k in ("thresholds", "tpr", "fpr", "auc", "threshold",
                                           "tpr_at_threshold", "fpr_at_threshold")}),
    )
    exchanges = None
    if replies is not None:
        rows, states = replies
        exchanges = Exchanges(reply_states=states, prompt_logits=oof[rows], labels=y[rows], cats=corpus.cats[rows],
                              kinds=BenignKinds(ordinary=corpus.kinds.ordinary[rows],
                                                lookalike=corpus.kinds.lookalike[rows]))
        r_readout, scales, r_thr, reply_det = fit_reply_guard(exchanges, readout, C=C)
        reply = {"reply_Q": r_readout.Q.astype(np.float32), "reply_centre": r_readout.centre.astype(np.float32),
                 "reply_scales": scales.astype(np.float32), "reply_weights": r_readout.weights.astype(np.float32),
                 "reply_bias": float(r_readout.bias), "reply_threshold": logit_to_teh(r_thr)}
        for key, value in reply.items():
            setattr(profile, key, value)
        # Safe OGD's check reads reply windows at the safety layer: the last block of the reply states
        benign = [r[:, -d:] for r, lab in zip(exchanges.reply_states, exchanges.labels, strict=True) if lab == 0]
        top = max(float(reply_window_scores(profile, r).max()) for r in benign if len(r))
        profile.window_threshold = top * REPLY_MARGIN
        reply_det["window"] = {"benign_reply_max": top, "margin": REPLY_MARGIN}
    step(3)
    profile.details = {
        "probe": {**spec.as_dict(), "layers": layers, "pool": SAFETY_POOL, "forbidden_dims": int(readout.Q.shape[1])},
        "threshold_rule": {"ordinary_budget": ordinary_budget, "lookalike_budget": lookalike_budget,
                           "folds": len(folds), "groups": "twin pairs held whole", **cost},
        "cv": prompt_report(corpus, oof, threshold_logit),
        "reply": {**reply_det, "head": {"kind": "logistic", "C": C}} if exchanges is not None else reply_det,
        "n_calibration": int(len(y)),
        "teh_definition": "100*sigmoid(a^T Q^T (h-c) + b): the probe's reading of the state's forbidden coordinates",
    }
    return profile


def reply_sample(rows: Sequence[dict[str, Any]], per_source: dict[str, int] | None = None, seed: int = 0) -> list[int]:
    """Corpus rows the reply guard is fitted on, fixed by ``seed``: ``per_source[kind]`` rows of each
    kind (``harmful``, ``lookalike``, ``ordinary``: a row's label, and a benign row's
    ``benign_kind``) of each source (:data:`REPLIES_PER_SOURCE`)."""
    per_source = per_source or REPLIES_PER_SOURCE
    rng = np.random.default_rng(seed)
    pick: list[int] = []
    sources = sorted({r["source_group"] for r in rows})
    for source in sources:
        for kind in ("harmful", "lookalike", "ordinary"):
            idx = [i for i, r in enumerate(rows) if r["source_group"] == source
                   and (r["label"] if r["label"] == "harmful" else r["benign_kind"]) == kind]
            if idx:
                pick += sorted(rng.choice(idx, size=min(per_source[kind], len(idx)), replace=False).tolist())
    return pick


def generate_reply_states(lm: Any, prompts: list[list[dict[str, str]]], layers: Sequence[int], *,
                          max_new_tokens: int = 24, batch_size: int = 16,
                          progress: Callable[[int], None] | None = None) -> list[np.ndarray]:
    """Greedy replies to ``prompts`` and their tokens' states at ``layers``, side by side
    (n, len(layers)·d) (the engine's own batching); ``progress(n)`` after every ``batch_size`` replies."""
    out: list[np.ndarray] = []
    for start in range(0, len(prompts), batch_size):
        part = prompts[start:start + batch_size]
        out += lm.reply_states(part, list(layers), max_new_tokens=max_new_tokens, batch_size=batch_size)
        if progress is not None:
            progress(len(part))
    return out


def build_safety_profile(lm: Any, layer: int, system_prompt: str, *, progress: Progress | None = None,
                         layers: Sequence[int] | None = None) -> SafetyProfile:
    """Run the calibration corpus through the model and fit the prompt probe, the reply guard and
    the thresholds (module docstring)."""
    from isagi.console.progress import counter
    from isagi.data.safety import load_safety_corpus

    def ticker(stage: str, total: int) -> Callable[[int], None] | None:
        return counter(progress, stage, total)

    layers = list(layers) if layers else read_layers(int(lm.num_layers), int(layer))
    rows = load_safety_corpus()
    chats = [chat(system_prompt, r["text"]) for r in rows]
    X = safety_states(lm, chats, layers, progress=ticker("Safety: states of the calibration prompts", len(chats)))
    corpus = Corpus.of(X, rows)
    pick = reply_sample(rows)
    R = generate_reply_states(lm, [chats[i] for i in pick], layers, max_new_tokens=REPLY_CALIBRATION_TOKENS,
                              progress=ticker("Safety: the model's replies, for the reply guard", len(pick)))
    return fit_safety_profile(corpus, layers, replies=(np.asarray(pick), R), progress=progress)
