"""Safe OGD exploration: steered chains from a seed concept, scored by the MCB.

Owns the exploration step (docs/architecture.md, Definitions: Safe OGD) and the chains built from it.

The step direction (orthogonal geodesic deviation). For a step prompt p (the
seed for step 1, the previous step's output afterwards) the model reads p and a
divergent variant of p ("... in a completely unexpected way"); u = h(variant) −
h(p) at layer L is the direction the model itself associates with diverging
from p. The current trajectory direction is t = h(p) − h(previous step's p)
(step 1: t = h(p) − c, c the safety centre). The step is the part of u
orthogonal to t, v = u − (u·t̂) t̂, normalised, so the chain deviates
sideways from where it was heading instead of running further along it.
It is scaled to the residual stream's own size at that point, ‖h(p)‖.

Safe OGD steers generation with s = α ‖h(p)‖ P_safe v̂, P_safe = I − Q_L Q_Lᵀ,
Q_L the forbidden directions the guards use at layer L
(:func:`isagi.safety.runtime.steering_subspace`: the prompt probe's direction there
and the reply guard's direction for reply states): by construction the step has no
component along them (‖Q_Lᵀ s‖ = 0 up to float error), so it moves neither guard's score. Regular OGD uses s = α ‖h(p)‖ v̂. The
vector is added to the residual stream after layer L for every position of
the step (prompt and reply) through the engine's steering (a forward hook on
transformers, a control vector on llama.cpp), which lives inside the
decoding's ``with`` block and is removed however the block ends.

What each step reports:
- ``teh``: the paper's TEH, the share of norm ‖Q_L Q_Lᵀ (h − c_L)‖ / ‖h − c_L‖ × 100
  (:func:`isagi.safety.runtime.share`), of the mean of the reply's residual states as they
  leave layer L, i.e. the captured layer
  output plus the step s (the state the rest of the network reads);
  ``teh_max``: the largest TEH at the stream guard's check points
  (:func:`isagi.safety.runtime.reply_window_scores`: mean of the newest 8 states,
  every 8 tokens) on those states; ``teh_response``: TEH of the mean reply
  state without adding s, the model's own response to having been steered.
  ``over_threshold``: ``teh_max`` above the profile's window threshold
  (:func:`window_threshold`: above every check point of the benign
  calibration replies in ``Q``), so "over" means the steering moved the reply
  into the forbidden subspace further than any ordinary reply goes. The
  turn's reply guard judges a reply with its prompt instead
  (:class:`isagi.safety.runtime.ReplyGuard`); a steered step has no one prompt whose
  harm is in question, the step itself is.
- ``coherence`` (0..1): 1 − (mean next-token NLL of the step's text given its
  prompt under the unsteered model) / ln |V|, i.e. how much better than a
  uniform guess the plain model finds the text; 1 is perfectly predictable,
  0 no better than chance.
- ``continuity``: cosine between the mean centred reply states of this and the
  previous step (None for the first step), reported beside coherence.
- ``forbidden_fraction``: ‖Q_Lᵀ s‖ / ‖s‖ of the step itself.

The chain is scored with the MIKU Creativity Benchmark (:mod:`isagi.explore.mcb`)
against the unsteered baseline reply to the first step's prompt.
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from contextlib import AbstractContextManager
from dataclasses import asdict, dataclass, field
from typing import TYPE_CHECKING, Any, Protocol

import numpy as np

from isagi.errors import InputError
from isagi.explore.mcb import STOPWORDS, Constraint, MCBResult, score_mcb
from isagi.safety.runtime import (
    SafetyProfile,
    project_safe,
    reply_window_scores,
    steering_subspace,
    teh,
    window_threshold,
)

ALPHA_RANGE = (0.05, 0.30)
DEFAULT_ALPHAS = (0.20, 0.10, 0.05)
DIVERGENT_PREFIX = "Think of it in a completely unexpected, surprising way. "


if TYPE_CHECKING:
    from isagi.config import Settings
    from isagi.engines.base import ModelEngine
    from isagi.profile import Profile


class ExploringEngine(Protocol):
    """What :func:`explore_on` needs of an :class:`isagi.pipeline.engine.Engine` (a layer above)."""

    @property
    def lm(self) -> ModelEngine: ...

    @property
    def profile(self) -> Profile: ...

    @property
    def settings(self) -> Settings: ...

    @property
    def model_turns(self) -> AbstractContextManager[object]: ...


def ogd_direction(h_plain: np.ndarray, h_divergent: np.ndarray, h_prev: np.ndarray) -> np.ndarray:
    """Unit step direction: the divergent shift u orthogonalised against the trajectory t."""
    u = np.asarray(h_divergent, np.float64) - np.asarray(h_plain, np.float64)
    t = np.asarray(h_plain, np.float64) - np.asarray(h_prev, np.float64)
    tn = np.linalg.norm(t)
    if tn > 1e-9:
        t_hat = t / tn
        u = u - (u @ t_hat) * t_hat
    n = np.linalg.norm(u)
    if n < 1e-9:
        raise InputError(
            "exploration found no divergent direction for this prompt (the divergent variant "
            "reads the same as the prompt): try a longer or more concrete seed concept."
        )
    return u / n


def step_vector(
    direction: np.ndarray, scale: float, alpha: float, Q: np.ndarray | None
) -> np.ndarray:
    """s = α · scale · P_safe v̂ (safe, ``Q`` given) or α · scale · v̂ (regular, ``Q`` None)."""
    v = np.asarray(direction, np.float64)
    if Q is not None:
        v = project_safe(Q, v)
    return alpha * float(scale) * v


@dataclass
class StepRecord:
    """One exploration step (fields explained in the module docstring)."""

    index: int
    alpha: float
    prompt: str
    text: str
    teh: float
    teh_max: float
    teh_response: float
    over_threshold: bool
    coherence: float
    continuity: float | None
    forbidden_fraction: float
    step_norm: float
    tokens: int


@dataclass
class ExplorationResult:
    """A chain: its steps, the baseline it is compared with, and its MCB score."""

    seed: str
    safe: bool
    layer: int
    reply_threshold: float
    keyword: str
    max_words: int
    baseline: str
    steps: list[StepRecord] = field(default_factory=list)
    mcb: MCBResult | None = None

    def to_dict(self) -> dict[str, Any]:
        out = asdict(self)
        out["mcb"] = self.mcb.to_dict() if self.mcb is not None else None
        return out


def keyword_for(seed: str) -> str:
    words = [w for w in seed.lower().replace("'", " ").split() if w.isalpha()]
    content = [w for w in words if w not in STOPWORDS]
    return (content or words or ["it"])[-1]


def step_prompt(index: int, seed: str, previous: str, keyword: str, max_words: int) -> str:
    """The user prompt of a step: the seed first, then the previous step's output."""
    rule = f' Use the word "{keyword}" and stay under {max_words} words.'
    if index == 0 or not previous.strip():
        return f"Write a short, imaginative piece about {seed}.{rule}"
    prev = " ".join(previous.split()[:40])
    return f'Take this further, in a new direction: "{prev}"{rule}'


def _alphas(steps: int, alphas: Sequence[float]) -> list[float]:
    if steps < 1:
        raise InputError("exploration needs at least one step (--steps 1 or more).")
    if not alphas:
        raise InputError("exploration needs at least one step size alpha.")
    out = [float(alphas[min(i, len(alphas) - 1)]) for i in range(steps)]
    lo, hi = ALPHA_RANGE
    for a in out:
        if not lo - 1e-9 <= a <= hi + 1e-9:
            raise InputError(f"step size alpha={a} is outside [{lo}, {hi}].")
    return out


def messages_for(text: str, system_prompt: str | None = None) -> list[dict[str, str]]:
    """The chat of one step: the product's system prompt (as calibration saw it), then the prompt."""
    msgs = [{"role": "system", "content": system_prompt}] if system_prompt else []
    return [*msgs, {"role": "user", "content": text}]


def generate_reply(
    lm: ModelEngine,
    prompt: str,
    layer: int,
    max_new_tokens: int,
    steer: np.ndarray | None = None,
    system_prompt: str | None = None,
) -> tuple[str, np.ndarray, list[int], list[dict[str, str]]]:
    """Greedy reply to ``prompt`` (optionally steered): text, reply states at L, ids, the chat.

    The states are the layer-L outputs before the steering vector is added
    (the engine's capture reads them so, on either backend).
    """
    from isagi.engines.base import GenerationOptions

    messages = messages_for(prompt, system_prompt)
    vec = None if steer is None else np.asarray(steer, np.float32)
    with lm.generation(messages, layer, GenerationOptions(max_new_tokens=max_new_tokens), steer=vec) as gen:
        gen.prefill()
        text = "".join(ev.text for ev in gen.stream())
        states = gen.reply_hidden()
        new_ids = list(gen.new_ids)
    return text.strip(), states, new_ids, messages


def coherence(lm: ModelEngine, messages: list[dict[str, str]], reply_ids: Sequence[int]) -> float:
    """1 − mean NLL of the reply tokens given the prompt (unsteered model) / ln |V|, in [0, 1]."""
    if not reply_ids:
        return 0.0
    nll = lm.reply_nll(messages, list(reply_ids))
    return float(np.clip(1.0 - nll / math.log(lm.vocab_size), 0.0, 1.0))


def explore(
    lm: ModelEngine,
    profile: SafetyProfile,
    seed: str,
    steps: int = 3,
    alphas: Sequence[float] = DEFAULT_ALPHAS,
    safe: bool = True,
    max_new_tokens: int = 40,
    *,
    layer: int | None = None,
    max_words: int = 60,
    baseline: str | None = None,
    system_prompt: str | None = None,
) -> ExplorationResult:
    """An OGD chain of ``steps`` steps from ``seed`` (Safe OGD unless ``safe=False``).

    ``baseline``: the unsteered reply to the first step's prompt, for the MCB's
    originality scores; generated here when not given. ``system_prompt``: the
    product's system prompt (``Settings.system_prompt``), so hidden states are
    read in the frame the safety profile was calibrated in.
    """
    from isagi.manifold.pooling import prompt_hidden_states

    seed = seed.strip()
    if not seed:
        raise InputError('give a seed concept to explore, e.g. isagi explore "the ocean".')
    step_alphas = _alphas(steps, alphas)
    L = int(layer if layer is not None else profile.layer)
    Q, c = (np.asarray(a, np.float64) for a in steering_subspace(profile, L))
    Qc = (Q, c)
    keyword = keyword_for(seed)
    first_prompt = step_prompt(0, seed, "", keyword, max_words)
    if baseline is None:
        baseline, *_ = generate_reply(
            lm, first_prompt, L, max_new_tokens, system_prompt=system_prompt
        )
    result = ExplorationResult(
        seed=seed,
        safe=safe,
        layer=L,
        reply_threshold=window_threshold(profile),
        keyword=keyword,
        max_words=max_words,
        baseline=baseline,
    )
    h_prev = c
    prev_text = ""
    prev_mean: np.ndarray | None = None
    embeddings: list[np.ndarray] = []
    for i, alpha in enumerate(step_alphas):
        prompt = step_prompt(i, seed, prev_text, keyword, max_words)
        # each prompt evaluated alone: the direction is a small difference of two states, which
        # the rounding of a shared batch (padding, a grouped llama_decode) would move
        h_plain, h_div = (prompt_hidden_states(lm, [messages_for(p, system_prompt)], L, batch_size=1)[0]
                          .astype(np.float64) for p in (prompt, DIVERGENT_PREFIX + prompt))
        v = ogd_direction(h_plain, h_div, h_prev)
        s = step_vector(v, float(np.linalg.norm(h_plain)), alpha, Q if safe else None)
        text, R, new_ids, step_chat = generate_reply(
            lm, prompt, L, max_new_tokens, steer=s, system_prompt=system_prompt
        )
        R = R.astype(np.float64)
        if not len(R):  # the model stopped at once: judge the step by its prompt state
            R = h_plain[None, :]
        steered = R + s  # what leaves layer L and the rest of the network reads
        teh_mean = float(teh(Qc, steered.mean(axis=0)))
        teh_checks = reply_window_scores(Qc, steered)
        teh_resp = float(teh(Qc, R.mean(axis=0)))
        mean_state = R.mean(axis=0) - c
        cont = None
        if prev_mean is not None:
            denom = np.linalg.norm(prev_mean) * np.linalg.norm(mean_state)
            cont = float(prev_mean @ mean_state / denom) if denom > 0 else 0.0
        s_norm = float(np.linalg.norm(s))
        result.steps.append(
            StepRecord(
                index=i + 1,
                alpha=alpha,
                prompt=prompt,
                text=text,
                teh=teh_mean,
                teh_max=float(teh_checks.max()),
                teh_response=teh_resp,
                over_threshold=bool(teh_checks.max() > window_threshold(profile)),
                coherence=coherence(lm, step_chat, new_ids),
                continuity=cont,
                forbidden_fraction=float(np.linalg.norm(Q.T @ s) / s_norm) if s_norm else 0.0,
                step_norm=s_norm,
                tokens=len(new_ids),
            )
        )
        embeddings.append(mean_state)
        prev_mean, h_prev, prev_text = mean_state, h_plain, text
    result.mcb = score_mcb(
        [st.text for st in result.steps],
        seed=seed,
        baselines=[baseline] if baseline else None,
        constraint=Constraint(keyword=keyword, max_words=max_words),
        embeddings=np.stack(embeddings) if len(embeddings) >= 2 else None,
    )
    return result


MAX_STEPS = 6  # the most steps one exploration may take (the page's slider offers 1-6)


def explore_on(
    engine: ExploringEngine, seed: str, *, steps: int = 3, safe: bool = True, max_new_tokens: int = 40
) -> ExplorationResult:
    """The one entry point of an exploration, for ``isagi explore`` and the web Explore panel
    alike: a chain (:func:`explore`) on the engine's model, read in the frame its safety profile
    was calibrated in (the engine's system prompt, part of the profile's key), as one of the
    engine's model turns (its steered steps take every sequence slot of the model: a control
    vector acts on the whole llama.cpp context).

    ``engine``: an :class:`isagi.pipeline.engine.Engine` (its ``lm``, ``profile``, ``settings`` and
    ``model_turns``). The server's limits win: at most :data:`MAX_STEPS` steps of at most
    ``ISAGI_MAX_NEW_TOKENS`` tokens each, whatever the caller asked for.
    """
    steps = max(1, min(int(steps), MAX_STEPS))
    max_new_tokens = max(1, min(int(max_new_tokens), int(engine.settings.max_new_tokens)))
    with engine.model_turns:
        if seed.strip():
            refuse_harmful_seed(engine, seed.strip())
        return explore(engine.lm, engine.profile.safety, seed, steps=steps, safe=safe,
                       max_new_tokens=max_new_tokens, system_prompt=engine.settings.system_prompt)


def refuse_harmful_seed(engine: ExploringEngine, seed: str) -> float:
    """The prompt guard's TEH of ``seed`` read as the chat reads a message alone (the engine's
    system prompt, then the seed, read out at the profile's layers as it was calibrated); raises
    :class:`~isagi.errors.SeedRefused` over the guard's threshold. An exploration's steps are
    replies to the seed's prompt, steered: Safe OGD keeps the steering out of the forbidden
    directions, not the seed's own topic, so a seed the chat would refuse is refused here too.
    (:func:`explore` itself checks nothing: the evaluations explore harmful seeds on purpose.)"""
    from isagi.errors import SeedRefused
    from isagi.safety.build import chat, safety_states
    from isagi.safety.runtime import category_of, teh

    safety = engine.profile.safety
    h = safety_states(engine.lm, [chat(engine.settings.system_prompt, seed)], safety.read_layers)[0]
    score = float(teh(safety, h))
    if score > safety.threshold:
        category = category_of(safety, h).replace("_", " ")
        raise SeedRefused(
            f"The explorer refuses this seed, as the chat would: it looks like {category} "
            f"(TEH {score:.1f} % against the threshold {safety.threshold:.1f} %). "
            "Explore another concept, or rephrase it with more context."
        )
    return score


def render(result: ExplorationResult) -> str:
    """Plain-text report of a chain, for `isagi explore`: each step, its TEH, and the index."""
    mode = "Safe OGD" if result.safe else "regular OGD (unprojected)"
    lines = [
        f"Exploring {result.seed!r} with {mode} at layer {result.layer} "
        f"(reply threshold {result.reply_threshold:.2f}% TEH)"
    ]
    for st in result.steps:
        flag = "OVER THRESHOLD" if st.over_threshold else "below threshold"
        lines.append(
            f"\nstep {st.index}  alpha={st.alpha:.2f}  TEH {st.teh:.2f}% (max {st.teh_max:.2f}%, "
            f"{flag})  coherence {st.coherence:.2f}"
        )
        lines.append(f"  {st.text}")
    if result.mcb is not None:
        m = result.mcb
        cc = "n/a" if m.constraint_creativity is None else f"{m.constraint_creativity:.1f}"
        lines.append(
            f"\nMIKU Creativity Benchmark: {m.index:.1f} (tier {m.tier})  "
            f"divergent {m.divergent_thinking:.1f} · associative {m.associative_breadth:.1f} · "
            f"originality {m.narrative_originality:.1f} · constraint {cc} · "
            f"metaphor {m.metaphor:.1f}"
        )
    return "\n".join(lines)
