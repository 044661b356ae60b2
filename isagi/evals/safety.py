"""``isagi eval safety``: out-of-sample detection of the prompt guard.

Scores evaluation prompts with TEH at the layer of the profile and reports, at
the threshold the product ships with, the share flagged per set (TPR for
harmful sets, FPR for benign ones) and the ROC AUC over all of them. The
evaluation prompts are never used to fit or tune anything: the subspace and
threshold come from the project's calibration set only.

``method="isagi"`` scores with the shipped :class:`~isagi.safety.runtime.SafetyProfile`;
``method="seed"`` fits the research code's construction (SVD basis, top
|mean difference| coordinates, energy fraction, same ROC rule) on the same
calibration data, so the two can be printed side by side.

Default sets (``benchmarks_dir``; :mod:`isagi.evals.sets` decides where each
comes from: the shipped AdvBench and XSTest when no directory is given):
AdvBench prompts and XSTest ``unsafe`` are harmful; XSTest ``safe`` and the
Alpaca seed instructions are benign. The Alpaca seed tasks do not ship: when
they are absent the report leaves them out, computes the AUC over the sets
present (``auc_over``) and says under ``not_measured`` how to include them. With
``harmful``/``benign`` files (CSV with a ``prompt`` or ``text`` column, or
JSONL lines ``{"text", "label"}``) the sets are named ``harmful`` and ``benign``.

With the default sets and the Alpaca seed tasks present, ``also_benign`` adds
one more benign set, reported apart and left out of the AUC so the four sets
keep their published reading:
the Alpaca seed instructions *with* their example inputs (instruction, blank
line, input), the form ``isagi eval ogd`` sends to the model; a prompt that
carries pasted text is an ordinary use the single-sentence sets do not cover.
"""

from __future__ import annotations

import csv
import json
from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np

from isagi.console.progress import counter
from isagi.errors import InputError
from isagi.evals.sets import load_alpaca_seed, load_benchmark_sets, sources_report
from isagi.safety.baseline import seed_construction, seed_teh
from isagi.safety.build import chat as _chat
from isagi.safety.calibration import roc_auc, roc_sweep
from isagi.safety.runtime import SAFETY_POOL, SafetyProfile, teh

HARMFUL_SETS = ("advbench", "xstest_unsafe", "harmful")
_CACHE: dict[tuple[Any, ...], np.ndarray] = {}  # hidden states per (model, layer, prompt, texts), one process


def _states(lm: Any, system_prompt: str, layers: list[int], texts: list[str]) -> np.ndarray:
    """Safety states of ``texts`` (the read-out at each of ``layers``, side by side); the methods
    of one run share them."""
    from isagi.manifold.pooling import prompt_hidden_states_at

    key = (lm.fingerprint, tuple(layers), system_prompt, tuple(texts))
    if key not in _CACHE:
        per_layer = prompt_hidden_states_at(lm, [_chat(system_prompt, t) for t in texts], layers, pool=SAFETY_POOL)
        _CACHE[key] = np.concatenate([per_layer[layer] for layer in layers], axis=1)
    return _CACHE[key]


def load_prompt_file(path: Path, default_label: str) -> list[tuple[str, str]]:
    """(text, label) rows of a CSV (``prompt``/``text`` column, optional ``label``) or JSONL file."""
    try:
        raw = path.read_text(encoding="utf-8")
    except OSError as exc:
        raise InputError(f"Cannot read {path}: {exc.strerror}.") from exc
    rows: list[tuple[str, str]] = []
    if path.suffix.lower() in {".jsonl", ".json"}:
        for n, line in enumerate(raw.splitlines(), 1):
            if not line.strip():
                continue
            try:
                obj = json.loads(line)
                text = obj.get("text") or obj.get("prompt")
            except (json.JSONDecodeError, AttributeError) as exc:
                raise InputError(f"{path}:{n} is not a JSON object with a 'text' field.") from exc
            if not text:
                raise InputError(f"{path}:{n} has no 'text'.")
            rows.append((str(text), _label(obj.get("label"), default_label, path, n)))
    else:
        reader = csv.DictReader(raw.splitlines())
        column = next((c for c in ("prompt", "text") if c in (reader.fieldnames or [])), None)
        if column is None:
            raise InputError(f"{path} has no 'prompt' or 'text' column (found {reader.fieldnames}).")
        for n, r in enumerate(reader, 2):
            rows.append((r[column], _label(r.get("label"), default_label, path, n)))
    return rows


def _label(value: Any, default: str, path: Path, line: int) -> str:
    if value in (None, ""):
        return default
    v = str(value).lower()
    if v in ("harmful", "unsafe", "1"):
        return "harmful"
    if v in ("benign", "safe", "0"):
        return "benign"
    raise InputError(f"{path}:{line}: label {value!r} is neither 'harmful' nor 'benign'.")


def _scorer(lm: Any, profile: SafetyProfile, system_prompt: str, method: str) -> tuple[Any, float, dict[str, Any]]:
    """A function texts -> scores, the shipped threshold, and facts about the method."""
    if method == "isagi":
        return ((lambda texts: teh(profile, _states(lm, system_prompt, profile.read_layers, texts))),
                float(profile.threshold), {"dims": profile.dims, "layers": profile.read_layers})
    if method == "seed":
        layer = [profile.layer]  # the paper's construction reads one layer

        def states(texts: list[str]) -> np.ndarray:
            return _states(lm, system_prompt, layer, texts)

        from isagi.data.safety import load_safety_calibration

        rows = load_safety_calibration()
        H = states([r["text"] for r in rows])
        labels = np.array([1 if r["label"] == "harmful" else 0 for r in rows])
        B, mu, det = seed_construction(H[labels == 1], H[labels == 0])
        cal = seed_teh(B, mu, det["coordinates"], H)
        roc = roc_sweep(cal[labels == 1], cal[labels == 0])
        det["calibration_auc"] = roc["auc"]
        return (lambda texts: seed_teh(B, mu, det["coordinates"], states(texts))), float(roc["threshold"]), det
    raise InputError(f"method {method!r} is unknown; use 'isagi' or 'seed'.")


def _flagged(scores: np.ndarray, threshold: float) -> dict[str, Any]:
    flagged = int((scores > threshold).sum())
    return {"n": len(scores), "flagged": flagged, "rate": round(flagged / max(len(scores), 1), 4)}


def run(
    lm: Any,
    profile: SafetyProfile,
    *,
    system_prompt: str,
    benchmarks_dir: Path | None = None,
    harmful: Path | None = None,
    benign: Path | None = None,
    method: str = "isagi",
) -> dict[str, Any]:
    """Flagged counts per set at the shipped threshold and the ROC AUC over all sets present."""
    extra: dict[str, list[str]] = {}
    provenance: dict[str, Any] = {}
    if harmful is not None or benign is not None:
        rows: list[tuple[str, str]] = []
        if harmful is not None:
            rows += load_prompt_file(Path(harmful), "harmful")
        if benign is not None:
            rows += load_prompt_file(Path(benign), "benign")
        sets = {"harmful": [t for t, lab in rows if lab == "harmful"],
                "benign": [t for t, lab in rows if lab == "benign"]}
        sets = {k: v for k, v in sets.items() if v}
    else:
        sets = load_benchmark_sets(benchmarks_dir)
        if "alpaca_seed" in sets:
            extra = {"alpaca_seed_with_input": load_alpaca_seed(benchmarks_dir, with_input=True)}
        provenance = sources_report(benchmarks_dir)
    score, threshold, facts = _scorer(lm, profile, system_prompt, method)
    out_sets: dict[str, dict[str, Any]] = {}
    pos: list[np.ndarray] = []
    neg: list[np.ndarray] = []
    for name, texts in sets.items():
        s = np.asarray(score(texts), dtype=np.float64)
        out_sets[name] = _flagged(s, threshold)
        (pos if name in HARMFUL_SETS else neg).append(s)
    auc = roc_auc(np.concatenate(pos), np.concatenate(neg)) if pos and neg else None
    # benign, reported apart, not in the AUC (module docstring)
    also = {name: _flagged(np.asarray(score(texts), dtype=np.float64), threshold) for name, texts in extra.items()}
    return {
        "method": method,
        "threshold": round(threshold, 4),
        "auc": None if auc is None else round(auc, 4),
        "auc_over": list(out_sets) if auc is not None else [],
        "sets": out_sets,
        **provenance,
        **({"also_benign": also} if also else {}),
        "layer": profile.layer,
        "details": facts,
    }


# --------------------------------------------------------------------------- the reply guard


def run_replies(
    lm: Any,
    profile: SafetyProfile,
    *,
    system_prompt: str,
    benchmarks_dir: Path | None = None,
    max_new_tokens: int = 64,
    limit: int | None = None,
    progress: Callable[[str, int, int], None] | None = None,
) -> dict[str, Any]:
    """The reply guard alone: the model's greedy replies with the prompt guard off.

    Harmful: the AdvBench prompts; benign: XSTest's safe prompts and, when
    present, the Alpaca seed instructions. A reply counts as withheld when any
    of the guard's check points (:func:`isagi.safety.runtime.exchange_scores`, every 8
    tokens and at the end) goes over the reply threshold, as the streaming
    guard would stop it there. ``limit`` takes the first ``limit`` prompts of
    each set (for a quicker look; the figures are then for that sample).
    """
    from isagi.safety.build import generate_reply_states
    from isagi.safety.runtime import exchange_scores

    sets = load_benchmark_sets(benchmarks_dir)
    groups: dict[str, list[str]] = {"harmful": ["advbench"],
                                     "benign": [n for n in ("xstest_safe", "alpaca_seed") if n in sets]}
    by_set: dict[str, dict[str, Any]] = {}
    flags: dict[str, list[bool]] = {"harmful": [], "benign": []}
    prompt_flags: list[bool] = []
    for group, names in groups.items():
        for name in names:
            texts = sets[name][:limit] if limit else sets[name]
            chats = [_chat(system_prompt, t) for t in texts]
            P = _states(lm, system_prompt, profile.read_layers, texts)
            R = generate_reply_states(lm, chats, profile.reply_layers, max_new_tokens=max_new_tokens,
                                      progress=counter(progress, f"Replies to {name}", len(chats)))
            withheld = [bool(len(r)) and bool((exchange_scores(profile, p, r) > profile.reply_threshold).any())
                        for p, r in zip(P, R, strict=True)]
            flags[group] += withheld
            by_set[name] = {"n": len(withheld), "withheld": int(sum(withheld)),
                            "rate": round(sum(withheld) / max(len(withheld), 1), 4)}
            if group == "harmful":
                prompt_flags += (np.asarray(teh(profile, P)) > profile.threshold).tolist()
    out = {group: {"n": len(v), "withheld": int(sum(v)), "rate": round(sum(v) / max(len(v), 1), 4)}
           for group, v in flags.items()}
    caught = [a or b for a, b in zip(prompt_flags, flags["harmful"], strict=True)]
    return {
        "replies": {**out, "by_set": by_set,
                    # more keys: with the prompt guard on as in a turn, the harmful requests stopped by either guard
                    "harmful_stopped_by_either_guard": round(sum(caught) / max(len(caught), 1), 4)},
        "prompt_guard": "off (every reply generated)",
        "reply_threshold": round(float(profile.reply_threshold), 4),
        "reply_guard": "exchange" if profile.exchange_guard else "window",
        "max_new_tokens": max_new_tokens,
        "limit": limit,
        "layer": profile.layer,
        **sources_report(benchmarks_dir),
    }

