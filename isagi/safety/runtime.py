"""The per-turn safety runtime: the TEH score, the streaming reply guard, Safe OGD's projector.

Owns what every turn measures against a calibrated :class:`SafetyProfile` (docs/architecture.md,
Definitions). Fitting that profile is :mod:`isagi.safety.calibration`, offline; a turn
imports none of it.

Definitions (precise, as implemented; docs/architecture.md, Definitions):

- The safety state ``s``: the ``content+post`` read-out (:mod:`isagi.manifold.pooling`: the
  mean over the user's message and the mean over the template's tokens after it, averaged) at
  each of the profile's :attr:`SafetyProfile.read_layers`, side by side. It comes from the
  turn's own prefill, which captures every read-out layer (no extra forward pass).
- The probe, written as a forbidden subspace (:class:`Readout`): ``Q`` is orthonormal and
  block-diagonal, its columns in each layer's block spanning the directions the probe reads
  there; ``c`` is the benign centre; a head ``f`` (linear, or one ReLU layer) reads the
  forbidden coordinates ``Qᵀ (s − c)``.
- ``TEH(s) = 100 σ(f(Qᵀ (s − c)))`` (percent): the probe's reading of the state's forbidden
  coordinates. The prompt guard refuses when it is over ``threshold``, so the number shown
  and the verdict agree.
- Safe OGD's projector at the safety layer ``P_safe = I − Q_L Q_Lᵀ``
  (:meth:`SafetyProfile.layer_subspace`: the prompt probe's directions there, which the reply
  guard reads too). Theorem (tested): a step ``P_safe v`` moves neither guard's score, and
  ``TEH(c + P_safe (s − c)) = TEH(c)``, the benign centre's reading.
- A ``(Q, c)`` pair, and a profile without a probe (``weights`` None), score by the paper's
  share of norm ``‖Q Qᵀ (h − c)‖ / ‖h − c‖ × 100`` (:func:`share`); Safe OGD's check of a
  steered reply's windows uses it in ``Q_L`` (:func:`window_scorer`).

The reply guard judges a reply together with the request it answers, as guard
models judge a response in the context of its prompt. The prompt probe reads both:
at each check point the *exchange state* is two numbers (:func:`exchange_states`),
the probe's logit of the mean of the newest 8 reply states at the read-out layers
(what the reply is saying now, read as the probe reads a request) and its logit of
the request itself. A two-input logistic head fitted on the model's own greedy
replies to calibration prompts (replies to harmful prompts, generated with the
prompt guard off, are the positives; replies to benign ones and to ordinary
requests the negatives) weighs them. Its threshold lets a stated share of the
out-of-fold scores (a reply's score: its largest check point) of the replies to
ordinary requests, and another of the replies to look-alikes, lie above it. Two numbers read through the probe, fitted on the whole calibration
corpus, generalise to replies from a source the head never saw; a head over the raw
states, fitted on a few hundred replies, did not (docs/measurements.md, "The reply
guard reads through the probe").

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
    # The reply guard's head over exchange states (:func:`exchange_states`: two logits of the
    # prompt probe), fitted on the model's replies; None: the reply guard scores reply windows in
    # Q against ``reply_threshold``.
    reply_Q: np.ndarray | None = None  # (2, 2): the exchange state's two coordinates
    reply_centre: np.ndarray | None = None  # (2,)
    reply_scales: np.ndarray | None = None  # (2,): mean sizes of the reply windows' and the prompts' logits
    # Safe OGD's check of steered replies (isagi.explore.chains): window TEH in Q, above every benign reply
    window_threshold: float | None = None
    # The probe (module docstring, "The probe"): the read-out layers whose states stand side by side
    # in ``h`` (in this order; None: ``layer`` alone), the probe's weight on each column of Q and its
    # bias. Without ``weights`` TEH is the paper's share of norm (:func:`share`).
    layers: list[int] | None = None
    weights: np.ndarray | None = None  # (m,), or (H,) with ``hidden``
    bias: float = 0.0
    # A probe with a hidden layer (:class:`Readout`): its input weights on Q's coordinates and biases
    hidden: np.ndarray | None = None  # (m, H)
    hidden_bias: np.ndarray | None = None  # (H,)
    reply_weights: np.ndarray | None = None  # (m_r,)
    reply_bias: float = 0.0

    @property
    def dims(self) -> int:
        return int(self.Q.shape[1])

    @property
    def read_layers(self) -> list[int]:
        """The layers the safety state is read at, in the order they stand in ``h``."""
        return list(self.layers) if self.layers else [int(self.layer)]

    @property
    def layer_width(self) -> int:
        """The residual stream's width d (``h`` is ``len(read_layers)`` blocks of it)."""
        return int(self.Q.shape[0]) // len(self.read_layers)

    def readout(self) -> Readout | tuple[np.ndarray, np.ndarray]:
        """What :func:`teh` scores a prompt state with: the probe, or (Q, c) for a profile without one."""
        if self.weights is None:
            return self.Q, self.centre
        parts = (self.Q, self.centre, self.weights, self.bias, self.hidden, self.hidden_bias)
        return _kept_readout(self, "_readout", parts)

    def reply_readout(self) -> Readout | tuple[np.ndarray, np.ndarray]:
        """The reply guard's scorer of exchange states (:func:`exchange_states`)."""
        if self.reply_Q is None or self.reply_centre is None:
            raise ValueError("this profile has no exchange reply guard")
        if self.reply_weights is None:
            return self.reply_Q, self.reply_centre
        return _kept_readout(self, "_reply_readout",
                             (self.reply_Q, self.reply_centre, self.reply_weights, self.reply_bias, None, None))

    def layer_subspace(self, layer: int) -> tuple[np.ndarray, np.ndarray]:
        """(Q_L (d, m), c_L (d,)): the forbidden directions the guards use in layer ``layer``'s
        residual stream, orthonormal, and the centre there; what Safe OGD projects out of a step.

        The prompt probe's directions at ``layer`` (when it reads that layer); the reply guard reads
        reply states through the same probe, so a step projected by ``I - Q_L Q_L^T`` moves
        neither guard's score (module docstring).
        """
        d, blocks = self.layer_width, self.read_layers
        Q = np.asarray(self.Q, np.float64)
        c = np.asarray(self.centre, np.float64)
        cols: list[np.ndarray] = []
        centre = c[:d] if len(blocks) == 1 else None
        if layer in blocks:
            i = blocks.index(layer)
            part = Q[i * d:(i + 1) * d]
            cols += [part[:, j] for j in range(part.shape[1]) if np.linalg.norm(part[:, j]) > 1e-8]
            centre = c[i * d:(i + 1) * d]
        if not cols or centre is None:
            raise ValueError(f"the safety profile reads no state at layer {layer} (its layers: {blocks})")
        basis, sv, _ = np.linalg.svd(np.stack(cols, axis=1), full_matrices=False)
        return basis[:, sv > 1e-6 * sv.max()], centre

    @property
    def reply_layers(self) -> list[int]:
        """The layers a reply is read at, side by side in this order: the probe's read-out layers
        with an exchange guard (:func:`exchange_states`), else the profile's layer."""
        return self.read_layers if self.exchange_guard else [int(self.layer)]

    @property
    def exchange_guard(self) -> bool:
        """Whether replies are judged with their prompt through the probe (:func:`exchange_states`)."""
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
            **({"layers": [int(x) for x in self.layers]} if self.layers else {}),
            **({"weights": np.asarray(self.weights, dtype=np.float32), "bias": float(self.bias)}
               if self.weights is not None else {}),
            **({"hidden": np.asarray(self.hidden, dtype=np.float32),
                "hidden_bias": np.asarray(self.hidden_bias, dtype=np.float32)} if self.hidden is not None else {}),
            **({"reply_weights": np.asarray(self.reply_weights, dtype=np.float32), "reply_bias": float(self.reply_bias)}
               if self.reply_weights is not None else {}),
        }

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> SafetyProfile:
        Q = np.asarray(state["Q"], dtype=np.float32)
        centre = np.asarray(state["centre"], dtype=np.float32)
        if Q.ndim != 2 or centre.shape != (Q.shape[0],):
            raise ValueError(f"safety profile shapes do not match: Q {Q.shape}, centre {centre.shape}")
        cats = [str(c) for c in state["categories"]]
        dirs = np.asarray(state["category_directions"], dtype=np.float32).reshape(len(cats), Q.shape[0])
        layers = [int(x) for x in state["layers"]] if state.get("layers") else None
        if layers and Q.shape[0] % len(layers):
            raise ValueError(f"safety profile: Q has {Q.shape[0]} rows, not a multiple of its {len(layers)} layers")
        probe: dict[str, Any] = {}
        if "hidden" in state:
            hidden = np.asarray(state["hidden"], dtype=np.float32)
            if hidden.ndim != 2 or hidden.shape[0] != Q.shape[1]:
                raise ValueError(f"safety profile: the probe's hidden layer {hidden.shape} does not read Q {Q.shape}")
            probe = {"hidden": hidden,
                     "hidden_bias": np.asarray(state["hidden_bias"], dtype=np.float32).reshape(hidden.shape[1]),
                     "weights": np.asarray(state["weights"], dtype=np.float32).reshape(hidden.shape[1]),
                     "bias": float(state["bias"])}
        elif "weights" in state:
            probe = {"weights": np.asarray(state["weights"], dtype=np.float32).reshape(Q.shape[1]),
                     "bias": float(state["bias"])}
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
            layers=layers,
            **probe,
            **_reply_fields(state),
        )


def _reply_fields(state: dict[str, Any]) -> dict[str, Any]:
    """The optional reply-guard arrays of a stored profile, shape-checked."""
    out: dict[str, Any] = {}
    if state.get("window_threshold") is not None:
        out["window_threshold"] = float(state["window_threshold"])
    if "reply_Q" not in state:
        return out
    rQ = np.asarray(state["reply_Q"], dtype=np.float32)
    rc = np.asarray(state["reply_centre"], dtype=np.float32)
    rs = np.asarray(state["reply_scales"], dtype=np.float32)
    # the exchange state is two logits of the prompt probe: a profile with a reply guard has a probe
    if rQ.ndim != 2 or rQ.shape[0] != 2 or rc.shape != (2,) or rs.shape != (2,) or "weights" not in state:
        raise ValueError(f"reply guard shapes do not match: reply_Q {rQ.shape}, centre {rc.shape}, scales {rs.shape}")
    if "reply_weights" in state:
        out.update(reply_weights=np.asarray(state["reply_weights"], dtype=np.float32).reshape(rQ.shape[1]),
                   reply_bias=float(state["reply_bias"]))
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


@dataclass
class Readout:
    """A probe written as a forbidden subspace: ``TEH(x) = 100 σ(f(Qᵀ (x − c)))``.

    ``Q`` (D, m) is orthonormal and block-diagonal: its columns in each block of ``x`` (a layer's
    residual stream, or a part of an exchange state) span the directions the probe reads there.
    ``c`` is the benign centre. The head ``f`` reads the forbidden coordinates ``u = Qᵀ (x − c)``:
    linear, ``f(u) = aᵀu + b`` with one column per block (``weights`` a); or, with ``hidden``
    (m, H) and ``hidden_bias`` (H,), one ReLU layer, ``f(u) = aᵀ relu(hiddenᵀ u + hidden_bias) + b``.
    Either way the score depends on ``x`` only through ``u``.
    """

    Q: np.ndarray
    centre: np.ndarray
    weights: np.ndarray
    bias: float
    hidden: np.ndarray | None = None
    hidden_bias: np.ndarray | None = None

    def logits(self, x: np.ndarray) -> np.ndarray:
        X = np.atleast_2d(np.asarray(x, dtype=np.float64)) - np.asarray(self.centre, dtype=np.float64)
        u = X @ np.asarray(self.Q, np.float64)
        if self.hidden is not None:
            u = np.maximum(u @ np.asarray(self.hidden, np.float64) + np.asarray(self.hidden_bias, np.float64), 0.0)
        return u @ np.asarray(self.weights, np.float64) + float(self.bias)


def _kept_readout(profile: SafetyProfile, name: str, parts: tuple[Any, ...]) -> Readout:
    """The profile's :class:`Readout` of ``parts`` (Q, centre, weights, bias, hidden, hidden_bias),
    its arrays cast to float64 once: every prompt and every reply check point scores with it, and
    casting a (D, m) Q on each call took most of a score's time. Made again when a part was
    replaced (kept in the instance's ``__dict__``, not a field: nothing saved or compared)."""
    kept = profile.__dict__.get(name)
    if kept is None or any(a is not b for a, b in zip(kept[0], parts, strict=True)):
        Q, centre, weights, bias, hidden, hidden_bias = parts
        readout = Readout(np.asarray(Q, np.float64), np.asarray(centre, np.float64), np.asarray(weights, np.float64),
                          float(bias), None if hidden is None else np.asarray(hidden, np.float64),
                          None if hidden_bias is None else np.asarray(hidden_bias, np.float64))
        kept = profile.__dict__[name] = (parts, readout)
    return kept[1]


def share(Q: np.ndarray, c: np.ndarray, h: np.ndarray) -> np.ndarray:
    """The paper's TEH: ``‖Q Qᵀ (h − c)‖ / ‖h − c‖ × 100`` of each row of ``h`` (n, d)."""
    x = np.atleast_2d(np.asarray(h, dtype=np.float64)) - np.asarray(c, dtype=np.float64)
    num = np.linalg.norm(x @ np.asarray(Q, dtype=np.float64), axis=1)  # ‖Q Qᵀ x‖ = ‖Qᵀ x‖ for orthonormal Q
    return 100.0 * num / np.maximum(np.linalg.norm(x, axis=1), _EPS)


def teh(scorer: SafetyProfile | Readout | tuple[np.ndarray, np.ndarray], h: np.ndarray) -> float | np.ndarray:
    """TEH in percent of ``h`` (D,) or of each row of ``h`` (n, D).

    A profile with a probe, or a :class:`Readout`: ``100 σ(probe logit)``, the probe's reading of
    the state's forbidden coordinates; a ``(Q, c)`` pair (or a profile without a probe): the
    paper's share of norm, :func:`share`.
    """
    if isinstance(scorer, SafetyProfile):
        scorer = scorer.readout()
    single = np.asarray(h).ndim == 1
    if isinstance(scorer, Readout):
        z = scorer.logits(h)
        out = 100.0 / (1.0 + np.exp(-np.clip(z, -60.0, 60.0)))
    else:
        out = share(scorer[0], scorer[1], h)
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
    """c + P_safe (h − c): the state with its forbidden component removed (its forbidden coordinates
    are the centre's: the paper's TEH of it is 0, the probe's is that of the benign centre)."""
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


def exchange_states(probe: Readout, reply_states: np.ndarray, prompt_logit: float, scales: np.ndarray, *,
                    every: int = 8, window: int = REPLY_WINDOW) -> np.ndarray:
    """One exchange state per check point of a reply (k, 2): [y / s_y, z / s_z].

    ``reply_states`` (n, len(read_layers)·d) are the reply tokens' states at the prompt probe's
    read-out layers, side by side as in a safety state; ``y`` is the probe's logit of the mean of
    the newest ``window`` of them at the check point, ``z`` (``prompt_logit``) its logit of the
    request; ``scales`` put both at unit mean size. The probe reads the reply as it reads a
    request: its directions were learnt from the whole calibration corpus, which the few hundred
    replies the head is fitted on could not teach a reader of raw reply states (module docstring).
    """
    states = np.asarray(reply_states, dtype=np.float64)
    points = _check_points(len(states), every)
    if not points:
        return np.zeros((0, 2))
    windows = np.stack([states[max(0, k - window):k].mean(axis=0) for k in points])
    y = np.asarray(probe.logits(windows), dtype=np.float64).reshape(len(points))
    return np.stack([y / float(scales[0]), np.full(len(points), float(prompt_logit) / float(scales[1]))], axis=1)


def probe_logit(profile: SafetyProfile, prompt_state: np.ndarray) -> float:
    """The prompt probe's logit of ``prompt_state`` (a profile with a probe)."""
    readout = profile.readout()
    if not isinstance(readout, Readout):
        raise ValueError("this safety profile has no probe: its TEH is a share of norm")
    return float(np.asarray(readout.logits(prompt_state)).reshape(-1)[0])


class ReplyGuard:
    """Streaming check of a reply: TEH of the newest reply states, with the prompt they answer.

    With an exchange guard in the profile (:attr:`SafetyProfile.exchange_guard`) it scores
    :func:`exchange_states` with the reply head, and reads reply states at every layer of
    :attr:`layers` (the probe's read-out layers, side by side); without one (a profile fitted
    without replies) the mean of the newest ``window`` reply states at the profile's layer in
    the prompt subspace ``Q``. The mean of several states summarises what the reply is
    currently saying; a single token's state is dominated by that token.
    """

    def __init__(self, profile: SafetyProfile, prompt_state: np.ndarray | None = None, every: int = 8,
                 window: int = REPLY_WINDOW) -> None:
        if profile.exchange_guard and prompt_state is None:
            raise ValueError("this profile's reply guard judges a reply with its prompt: pass prompt_state")
        self.profile = profile
        self.layers = profile.reply_layers  # the reply states :meth:`score` takes, side by side
        # an exchange guard's readers and the prompt's logit, once per reply (not per check point)
        self._head = profile.reply_readout() if profile.exchange_guard else None
        self._probe = profile.readout()
        self.prompt_logit = probe_logit(profile, prompt_state) if profile.exchange_guard else None  # type: ignore[arg-type]
        self.every = every
        self.window = window
        self.max_teh = 0.0

    def score(self, reply_hidden: np.ndarray) -> float:
        """TEH % of the newest window of ``reply_hidden`` (n, len(layers)·d)."""
        states = np.asarray(reply_hidden)
        if states.ndim == 1:
            states = states[None, :]
        if len(states) == 0:
            return 0.0
        prof = self.profile
        if self._head is not None:
            assert isinstance(self._probe, Readout) and self.prompt_logit is not None and prof.reply_scales is not None
            newest = states[-self.window:]
            x = exchange_states(self._probe, newest, self.prompt_logit, prof.reply_scales, every=len(newest),
                                window=self.window)[-1]
            return float(teh(self._head, x))
        return float(teh(window_scorer(prof), states[-self.window :].mean(axis=0)))

    def check(self, reply_hidden: np.ndarray) -> tuple[bool, float]:
        """(over the reply threshold?, TEH %) for the newest window of reply states."""
        value = self.score(reply_hidden)
        self.max_teh = max(self.max_teh, value)
        return value > self.profile.reply_threshold, value


def window_threshold(profile: SafetyProfile) -> float:
    """The threshold for :func:`reply_window_scores` (a profile without one: its reply threshold)."""
    return float(profile.reply_threshold if profile.window_threshold is None else profile.window_threshold)


def steering_subspace(profile: Any, layer: int) -> tuple[np.ndarray, np.ndarray]:
    """(Q_L, c_L) Safe OGD projects out of a step at ``layer``: a probe profile's forbidden
    directions there (:meth:`SafetyProfile.layer_subspace`), else the profile's own ``Q`` and centre."""
    if isinstance(profile, SafetyProfile) and profile.weights is not None:
        return profile.layer_subspace(layer)
    return np.asarray(profile.Q), np.asarray(profile.centre)


def window_scorer(profile: SafetyProfile) -> tuple[np.ndarray, np.ndarray]:
    """(Q, c) that scores one reply window (d,) by the paper's share of norm: the profile's own
    subspace, or with a probe its forbidden directions at its layer (:meth:`SafetyProfile.layer_subspace`)."""
    if profile.weights is None:
        return profile.Q, profile.centre
    return profile.layer_subspace(profile.layer)


def reply_window_scores(profile_or_Q_c: Any, reply_states: np.ndarray, window: int = REPLY_WINDOW, every: int = 8) -> np.ndarray:
    """TEH (share of norm) in the forbidden subspace of the window mean at every check point of one reply."""
    scorer = window_scorer(profile_or_Q_c) if isinstance(profile_or_Q_c, SafetyProfile) else profile_or_Q_c
    states = np.asarray(reply_states, dtype=np.float64)
    return np.array([teh(scorer, states[max(0, p - window) : p].mean(axis=0))
                     for p in _check_points(len(states), every)])


def exchange_scores(profile: SafetyProfile, prompt_state: np.ndarray, reply_states: np.ndarray,
                    every: int = 8) -> np.ndarray:
    """TEH at every check point a :class:`ReplyGuard` would use on one reply (any profile)."""
    guard = ReplyGuard(profile, prompt_state, every=every)
    states = np.asarray(reply_states)
    return np.array([guard.score(states[:k]) for k in _check_points(len(states), every)])

