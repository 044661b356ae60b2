"""The per-turn safety runtime: the TEH score, the streaming reply guard, Safe OGD's projector.

Owns what every turn measures against a calibrated :class:`SafetyProfile` (docs/architecture.md,
Definitions). Fitting that profile is :mod:`isagi.safety.calibration`, offline; a turn
imports none of it.

Definitions (precise, as implemented):

- Forbidden subspace ``Q`` (d×m, orthonormal columns) and centre ``c`` (d,).
- ``TEH(h) = ‖Q Qᵀ (h − c)‖ / ‖h − c‖ × 100`` (percent, in [0, 100]).
- Safe OGD's projector ``P_safe = I − Q Qᵀ`` (linear, symmetric, idempotent).
- Theorem (tested): for every ``h`` with ``P_safe(h − c) ≠ 0``,
  ``TEH(c + P_safe (h − c)) = 0``: the projector acts on the state measured
  from the centre, the frame in which TEH is defined. Equivalently, a step
  ``α · P_safe v`` has no component along any forbidden direction
  (``Qᵀ P_safe v = 0``), which is what exploration relies on. The centre has a
  forbidden component on purpose (see below), so the theorem is *not*
  ``TEH(P_safe h) = 0`` for the raw ``h`` unless ``Qᵀ c = 0``;
  :func:`safe_point` is the map for which TEH is exactly zero.

The safety state of a prompt is read at the safety layer over two token
spans (:mod:`isagi.manifold.pooling`, ``content+post``): the mean over the user's
message (:meth:`isagi.engines.hf.model.LoadedModel.content_span`) and the mean over the
post-instruction tokens after it (the template's end of the message and the
opening of the assistant's turn), averaged. Published work reads harmfulness
best at the post-instruction tokens; the message mean keeps what every word
contributed. Leave-one-category-out cross-validation on the calibration set
chose it over the message mean alone, the post-instruction mean alone and the
last token (``isagi eval safety-cv``; the figures are at ``SAFETY_POOL``). It
comes from the turn's own prefill: both spans are evaluated in every turn
(the KV cache may only supply tokens before the message), so it costs no
extra forward pass.

The reply guard judges a reply together with the request it answers, as guard
models judge a response in the context of its prompt: an *exchange state*
``[prompt safety state / s_p, mean of the newest 8 reply states / s_r]``
(:func:`exchange_states`) is scored by TEH in a second forbidden subspace,
fitted by the same Snipe on the model's own greedy replies to calibration
prompts (replies to harmful prompts, generated with the prompt guard off, are
the positives; replies to benign ones and to ordinary requests the
negatives). Its threshold lets ``REPLY_FPR_BUDGET`` of the benign replies'
out-of-fold scores (a reply's score: its largest check point) lie above it.
Safe OGD's check of steered replies keeps the prompt subspace ``Q``
(:func:`window_threshold`), since its question is whether a step moved the
reply along a forbidden direction.

Ordinary generation is never steered or ablated here: removing the
harmful-minus-benign direction from the residual stream is the published way
to strip a model's refusals (Arditi et al., NeurIPS 2024).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import numpy as np

from isagi.data.safety import SAFETY_CATEGORIES as CATEGORIES  # noqa: F401 - re-exported; one list of categories

REFUSAL_TEMPLATE = (
    "I can't help with that: it looks like {category}. "
    "If I misread you, please rephrase the request with more context."
)
REPLY_WINDOW = 8
SAFETY_POOL = "content+post"  # the safety state (isagi.manifold.pooling): see the module docstring

_EPS = 1e-12


# --------------------------------------------------------------------------- profile


@dataclass
class SafetyProfile:
    """The calibrated forbidden subspace with its centre, thresholds and ROC."""

    Q: np.ndarray  # (d, m) orthonormal
    centre: np.ndarray  # (d,)
    threshold: float  # TEH % for prompts
    reply_threshold: float  # TEH % for the mean of the last REPLY_WINDOW reply states
    layer: int
    categories: list[str]
    category_directions: np.ndarray  # (c, d) unit probe directions, one per category
    category_bias: np.ndarray  # (c,) probe offsets: score_k(h) = w_k·h + b_k
    roc: dict[str, Any]  # {"thresholds", "tpr", "fpr", "auc"} on the calibration set
    details: dict[str, Any] = field(default_factory=dict)  # per-category AUCs, selection, budget, CV
    # The reply guard's own subspace over exchange states (:func:`exchange_states`), fitted on the
    # model's replies; None: the reply guard scores reply windows in Q against ``reply_threshold``.
    reply_Q: np.ndarray | None = None  # (2d, m_r) orthonormal
    reply_centre: np.ndarray | None = None  # (2d,)
    reply_scales: np.ndarray | None = None  # (2,): mean norms of prompt states and of reply windows
    # Safe OGD's check of steered replies (isagi.explore.chains): window TEH in Q, above every benign reply
    window_threshold: float | None = None

    @property
    def dims(self) -> int:
        return int(self.Q.shape[1])

    @property
    def exchange_guard(self) -> bool:
        """Whether replies are judged with their prompt (:func:`exchange_states`)."""
        return self.reply_Q is not None

    def to_state(self) -> dict[str, Any]:
        """Numpy arrays plus JSON-able scalars and lists (the profile stores them apart)."""
        return {
            "Q": np.asarray(self.Q, dtype=np.float32),
            "centre": np.asarray(self.centre, dtype=np.float32),
            "category_directions": np.asarray(self.category_directions, dtype=np.float32),
            "category_bias": np.asarray(self.category_bias, dtype=np.float32),
            "threshold": float(self.threshold),
            "reply_threshold": float(self.reply_threshold),
            "layer": int(self.layer),
            "categories": list(self.categories),
            "roc": _jsonable(self.roc),
            "details": _jsonable(self.details),
            **({"reply_Q": np.asarray(self.reply_Q, dtype=np.float32),
                "reply_centre": np.asarray(self.reply_centre, dtype=np.float32),
                "reply_scales": np.asarray(self.reply_scales, dtype=np.float32)} if self.exchange_guard else {}),
            **({"window_threshold": float(self.window_threshold)} if self.window_threshold is not None else {}),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SafetyProfile:
        Q = np.asarray(state["Q"], dtype=np.float32)
        centre = np.asarray(state["centre"], dtype=np.float32)
        if Q.ndim != 2 or centre.shape != (Q.shape[0],):
            raise ValueError(f"safety profile shapes do not match: Q {Q.shape}, centre {centre.shape}")
        cats = [str(c) for c in state["categories"]]
        dirs = np.asarray(state["category_directions"], dtype=np.float32).reshape(len(cats), Q.shape[0])
        return cls(
            Q=Q,
            centre=centre,
            threshold=float(state["threshold"]),
            reply_threshold=float(state["reply_threshold"]),
            layer=int(state["layer"]),
            categories=cats,
            category_directions=dirs,
            category_bias=np.asarray(state["category_bias"], dtype=np.float32).reshape(len(cats)),
            roc=dict(state.get("roc", {})),
            details=dict(state.get("details", {})),
            **_reply_fields(state, Q.shape[0]),
        )


def _reply_fields(state: dict[str, Any], d: int) -> dict[str, Any]:
    """The optional reply-guard arrays of a stored profile, shape-checked."""
    out: dict[str, Any] = {}
    if state.get("window_threshold") is not None:
        out["window_threshold"] = float(state["window_threshold"])
    if "reply_Q" not in state:
        return out
    rQ = np.asarray(state["reply_Q"], dtype=np.float32)
    rc = np.asarray(state["reply_centre"], dtype=np.float32)
    rs = np.asarray(state["reply_scales"], dtype=np.float32)
    if rQ.ndim != 2 or rQ.shape[0] != 2 * d or rc.shape != (2 * d,) or rs.shape != (2,):
        raise ValueError(f"reply guard shapes do not match: reply_Q {rQ.shape}, centre {rc.shape}, scales {rs.shape}")
    return {**out, "reply_Q": rQ, "reply_centre": rc, "reply_scales": rs}


def _jsonable(value: Any) -> Any:
    if isinstance(value, dict):
        return {str(k): _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    if isinstance(value, np.ndarray):
        return value.tolist()
    if isinstance(value, np.generic):
        return value.item()
    return value


# --------------------------------------------------------------------------- TEH and projector


def teh(profile_or_Q_c: SafetyProfile | tuple[np.ndarray, np.ndarray], h: np.ndarray) -> float | np.ndarray:
    """TEH in percent of ``h`` (d,) or of each row of ``h`` (n, d)."""
    if isinstance(profile_or_Q_c, SafetyProfile):
        Q, c = profile_or_Q_c.Q, profile_or_Q_c.centre
    else:
        Q, c = profile_or_Q_c
    Q = np.asarray(Q, dtype=np.float64)
    x = np.asarray(h, dtype=np.float64) - np.asarray(c, dtype=np.float64)
    single = x.ndim == 1
    X = x[None, :] if single else x
    num = np.linalg.norm(X @ Q, axis=1)  # ‖Q Qᵀ x‖ = ‖Qᵀ x‖ for orthonormal Q
    den = np.linalg.norm(X, axis=1)
    out = 100.0 * num / np.maximum(den, _EPS)
    return float(out[0]) if single else out


def safe_projector(Q: np.ndarray) -> np.ndarray:
    """P_safe = I − Q Qᵀ (d, d)."""
    Q = np.asarray(Q, dtype=np.float64)
    return np.eye(Q.shape[0]) - Q @ Q.T


def project_safe(Q: np.ndarray, v: np.ndarray) -> np.ndarray:
    """P_safe v without forming the d×d matrix (rows of ``v`` if 2-D)."""
    Q = np.asarray(Q, dtype=np.float64)
    v = np.asarray(v, dtype=np.float64)
    return v - (v @ Q) @ Q.T


def safe_point(profile_or_Q_c: SafetyProfile | tuple[np.ndarray, np.ndarray], h: np.ndarray) -> np.ndarray:
    """c + P_safe (h − c): the state with its forbidden component removed; TEH of it is 0."""
    if isinstance(profile_or_Q_c, SafetyProfile):
        Q, c = profile_or_Q_c.Q, profile_or_Q_c.centre
    else:
        Q, c = profile_or_Q_c
    c = np.asarray(c, dtype=np.float64)
    return c + project_safe(Q, np.asarray(h, dtype=np.float64) - c)


def category_of(profile: SafetyProfile, h: np.ndarray) -> str:
    """The calibration category whose probe scores ``h`` highest (for the refusal message)."""
    scores = profile.category_directions.astype(np.float64) @ np.asarray(h, dtype=np.float64)
    scores = scores + profile.category_bias.astype(np.float64)
    return profile.categories[int(np.argmax(scores))]


# --------------------------------------------------------------------------- reply guard


def _check_points(n: int, every: int) -> list[int]:
    """Reply lengths at which the guard checks: every ``every`` tokens, and the end."""
    points = list(range(every, n + 1, every))
    if n and (not points or points[-1] != n):
        points.append(n)
    return points


def exchange_states(prompt_state: np.ndarray, reply_states: np.ndarray, scales: np.ndarray, *,
                    every: int = 8, window: int = REPLY_WINDOW) -> np.ndarray:
    """One exchange state (2d,) per check point of a reply: [prompt state / s_p, window mean / s_r].

    The window mean is that of the newest ``window`` reply states at the check
    point; ``scales`` (s_p, s_r) put both halves at unit mean norm. A reply is
    judged with the request it answers, as guard models judge a response in
    the context of its prompt: on the replies of SmolLM2-135M the reply
    windows alone separate the replies to harmful and to benign calibration
    prompts poorly, with the prompt beside them well (docs/measurements.md,
    "How a turn works", step 7).
    """
    states = np.asarray(reply_states, dtype=np.float64)
    p = np.asarray(prompt_state, dtype=np.float64) / float(scales[0])
    rows = [np.concatenate([p, states[max(0, k - window):k].mean(axis=0) / float(scales[1])])
            for k in _check_points(len(states), every)]
    return np.stack(rows) if rows else np.zeros((0, 2 * len(p)))


class ReplyGuard:
    """Streaming check of a reply: TEH of the newest reply states, with the prompt they answer.

    With an exchange guard in the profile (:attr:`SafetyProfile.exchange_guard`)
    it scores :func:`exchange_states` in the reply subspace; without one (a
    profile fitted without replies) the mean of the newest ``window`` reply
    states in the prompt subspace ``Q``. The mean of several states summarises
    what the reply is currently saying; a single token's state is dominated by
    that token.
    """

    def __init__(self, profile: SafetyProfile, prompt_state: np.ndarray | None = None, every: int = 8,
                 window: int = REPLY_WINDOW) -> None:
        if profile.exchange_guard and prompt_state is None:
            raise ValueError("this profile's reply guard judges a reply with its prompt: pass prompt_state")
        self.profile = profile
        self.prompt_state = prompt_state
        self.every = every
        self.window = window
        self.max_teh = 0.0

    def score(self, reply_hidden: np.ndarray) -> float:
        states = np.asarray(reply_hidden)
        if states.ndim == 1:
            states = states[None, :]
        if len(states) == 0:
            return 0.0
        prof = self.profile
        if prof.exchange_guard:
            x = exchange_states(self.prompt_state, states[-self.window:], prof.reply_scales,  # type: ignore[arg-type]
                                every=len(states[-self.window:]), window=self.window)[-1]
            return float(teh((prof.reply_Q, prof.reply_centre), x))  # type: ignore[arg-type]
        return float(teh(prof, states[-self.window :].mean(axis=0)))

    def check(self, reply_hidden: np.ndarray) -> tuple[bool, float]:
        """(over the reply threshold?, TEH %) for the newest window of reply states."""
        value = self.score(reply_hidden)
        self.max_teh = max(self.max_teh, value)
        return value > self.profile.reply_threshold, value


def window_threshold(profile: SafetyProfile) -> float:
    """The threshold for :func:`reply_window_scores` (a profile without one: its reply threshold)."""
    return float(profile.reply_threshold if profile.window_threshold is None else profile.window_threshold)


def reply_window_scores(profile_or_Q_c: Any, reply_states: np.ndarray, window: int = REPLY_WINDOW, every: int = 8) -> np.ndarray:
    """TEH in the prompt subspace of the window mean at every check point of one reply."""
    states = np.asarray(reply_states, dtype=np.float64)
    return np.array([teh(profile_or_Q_c, states[max(0, p - window) : p].mean(axis=0))
                     for p in _check_points(len(states), every)])


def exchange_scores(profile: SafetyProfile, prompt_state: np.ndarray, reply_states: np.ndarray,
                    every: int = 8) -> np.ndarray:
    """TEH at every check point a :class:`ReplyGuard` would use on one reply (any profile)."""
    guard = ReplyGuard(profile, prompt_state, every=every)
    states = np.asarray(reply_states)
    return np.array([guard.score(states[:k]) for k in _check_points(len(states), every)])

