"""The MIKU Creativity Benchmark (MCB): five automatic scores and one index.

Owns scoring a set of generated texts (the steps of an exploration chain, or a
single reply) on the five dimensions the paper names, each 0..100, and their
weighted combination into a 0..100 index with a tier. Every score is a pure
function of the texts (plus, for associative breadth, optional embeddings the
caller computed with the model), so the benchmark is deterministic and
reproducible. Definitions (words = lower-cased ``[a-z']+`` tokens):

- divergent thinking (DT): lexical spread of everything produced,
  100 × (distinct-1 + distinct-2) / 2 over the concatenated texts
  (distinct-n = unique n-grams / all n-grams).
- associative breadth (AB): how far apart the units are. Units are the texts
  (or the sentences of a single text). With embeddings (one per text, e.g. the
  mean centred reply hidden state), 100 × mean pairwise cosine distance clipped
  to [0, 1]; otherwise 100 × mean pairwise (1 − Jaccard) of content-word sets.
  Fewer than two units: 0.
- narrative originality (NO): 100 × mean over texts of the share of the text's
  word bigrams that occur in no reference text. References are the unsteered
  baseline replies when given, otherwise the seed.
- constraint creativity (CC): the prompt states a :class:`Constraint` (use a
  keyword, stay under N words). Per text: sat = share of the constraint's
  checks that hold; score = 100 × sat × (0.5 + 0.5 × the text's bigram
  novelty as in NO). No constraint: CC is ``None`` and left out of the index.
- metaphor (MET): 100 × min(1, figurative markers / sentences). Markers are
  simile and metaphor constructions found by the patterns in
  :data:`FIGURATIVE_PATTERNS` ("like a", "as … as", "as if", "resembles",
  "a tapestry of", …).

Index = weighted mean with :data:`WEIGHTS` (DT 0.20, AB 0.20, NO 0.25, CC 0.15,
MET 0.20; renormalised over the dimensions present). Tiers: S ≥ 85, A ≥ 70,
B ≥ 55, C ≥ 40, D below.
"""

from __future__ import annotations

import itertools
import re
from collections.abc import Sequence
from dataclasses import asdict, dataclass

import numpy as np

WEIGHTS: dict[str, float] = {
    "divergent_thinking": 0.20,
    "associative_breadth": 0.20,
    "narrative_originality": 0.25,
    "constraint_creativity": 0.15,
    "metaphor": 0.20,
}
TIERS: tuple[tuple[float, str], ...] = ((85.0, "S"), (70.0, "A"), (55.0, "B"), (40.0, "C"))

_WORD = re.compile(r"[a-z']+")
_SENTENCE_SPLIT = re.compile(r"[.!?;\n]+")
_VEHICLES = (
    "tapestry|symphony|dance|sea|ocean|river|whisper|canvas|mosaic|labyrinth|mirror|echo|"
    "song|heartbeat|thread|web|melody|garden|storm|flame|veil|maze|kaleidoscope|chorus|"
    "orchestra|sanctuary|cradle|bridge|window|doorway"
)
FIGURATIVE_PATTERNS: tuple[re.Pattern[str], ...] = (
    re.compile(r"\blike (?:a|an|the|some)\b"),
    re.compile(r"\bas (?:\w+ ){0,2}?as (?:a|an|the)\b"),
    re.compile(r"\bas (?:if|though)\b"),
    re.compile(r"\b(?:resembl\w*|akin to|reminiscent of)\b"),
    re.compile(rf"\b(?:a|an|the) (?:\w+ )?(?:{_VEHICLES})s? of\b"),
)
STOPWORDS = frozenset(
    """a an the and or but if of to in on at by for with from as is are was were be been being
    it its this that these those there their they them he she his her we our you your i me my
    not no so than then too very can will would could should may might do does did have has had
    into over under about above below up down out off again once all any both each few more most
    other some such only own same just also what which who whom when where why how while""".split()  # noqa: SIM905
)


@dataclass(frozen=True)
class Constraint:
    """A constraint stated in the prompt: include ``keyword``; use at most ``max_words`` words."""

    keyword: str | None = None
    max_words: int | None = None

    def checks(self, text: str) -> list[bool]:
        words = _words(text)
        out: list[bool] = []
        if self.keyword:
            key = self.keyword.lower()
            out.append(any(w.startswith(key) for w in words))  # "ocean" also matches "oceans"
        if self.max_words is not None:
            out.append(0 < len(words) <= self.max_words)
        return out


@dataclass(frozen=True)
class MCBResult:
    """The five dimension scores (0..100; CC may be None), the index and its tier."""

    divergent_thinking: float
    associative_breadth: float
    narrative_originality: float
    constraint_creativity: float | None
    metaphor: float
    index: float
    tier: str

    def to_dict(self) -> dict[str, float | str | None]:
        return asdict(self)


def _words(text: str) -> list[str]:
    return _WORD.findall(text.lower())


def _ngrams(words: Sequence[str], n: int) -> list[tuple[str, ...]]:
    return [tuple(words[i : i + n]) for i in range(len(words) - n + 1)]


def _distinct(words: Sequence[str], n: int) -> float:
    grams = _ngrams(words, n)
    return len(set(grams)) / len(grams) if grams else 0.0


def sentences(text: str) -> list[str]:
    """Sentences with at least three words."""
    return [s.strip() for s in _SENTENCE_SPLIT.split(text) if len(_words(s)) >= 3]


def tier(index: float) -> str:
    """S / A / B / C / D for a 0..100 index."""
    for bound, name in TIERS:
        if index >= bound:
            return name
    return "D"


def divergent_thinking(texts: Sequence[str]) -> float:
    words = [w for t in texts for w in _words(t)]
    return 100.0 * (_distinct(words, 1) + _distinct(words, 2)) / 2.0


def associative_breadth(texts: Sequence[str], embeddings: np.ndarray | None = None) -> float:
    if embeddings is not None and len(texts) >= 2:
        e = np.asarray(embeddings, dtype=np.float64)
        if e.shape[0] != len(texts):
            raise ValueError("associative_breadth: one embedding per text is required")
        e = e / np.maximum(np.linalg.norm(e, axis=1, keepdims=True), 1e-12)
        dists = [1.0 - float(e[i] @ e[j]) for i, j in itertools.combinations(range(len(e)), 2)]
        return 100.0 * float(np.clip(np.mean(dists), 0.0, 1.0))
    units = list(texts) if len(texts) >= 2 else (sentences(texts[0]) if texts else [])
    sets = [{w for w in _words(u) if w not in STOPWORDS} for u in units]
    if len(sets) < 2:
        return 0.0
    dists = []
    for a, b in itertools.combinations(sets, 2):
        union = a | b
        dists.append(1.0 - (len(a & b) / len(union) if union else 1.0))
    return 100.0 * float(np.mean(dists))


def bigram_novelty(text: str, references: Sequence[str]) -> float:
    """Share (0..1) of the text's word bigrams found in no reference text."""
    grams = _ngrams(_words(text), 2)
    if not grams:
        return 0.0
    seen = {g for r in references for g in _ngrams(_words(r), 2)}
    return sum(g not in seen for g in grams) / len(grams)


def narrative_originality(texts: Sequence[str], references: Sequence[str]) -> float:
    if not texts:
        return 0.0
    return 100.0 * float(np.mean([bigram_novelty(t, references) for t in texts]))


def constraint_creativity(
    texts: Sequence[str], constraint: Constraint, references: Sequence[str]
) -> float:
    scores = []
    for t in texts:
        checks = constraint.checks(t)
        sat = sum(checks) / len(checks) if checks else 1.0
        scores.append(100.0 * sat * (0.5 + 0.5 * bigram_novelty(t, references)))
    return float(np.mean(scores)) if scores else 0.0


def figurative_markers(text: str) -> int:
    low = text.lower()
    return sum(len(p.findall(low)) for p in FIGURATIVE_PATTERNS)


def metaphor(texts: Sequence[str]) -> float:
    n_sent = sum(max(1, len(sentences(t))) for t in texts if _words(t))
    if n_sent == 0:
        return 0.0
    markers = sum(figurative_markers(t) for t in texts)
    return 100.0 * min(1.0, markers / n_sent)


def score_mcb(
    texts: Sequence[str],
    *,
    seed: str = "",
    baselines: Sequence[str] | None = None,
    constraint: Constraint | None = None,
    embeddings: np.ndarray | None = None,
) -> MCBResult:
    """Score ``texts`` on the five MCB dimensions and combine them (module docstring)."""
    texts = [t for t in texts]
    refs = list(baselines) if baselines else ([seed] if seed else [])
    dt = divergent_thinking(texts)
    ab = associative_breadth(texts, embeddings)
    no = narrative_originality(texts, refs)
    cc = constraint_creativity(texts, constraint, refs) if constraint is not None else None
    mt = metaphor(texts)
    dims: dict[str, float | None] = {
        "divergent_thinking": dt, "associative_breadth": ab, "narrative_originality": no,
        "constraint_creativity": cc, "metaphor": mt,
    }
    present = {k: v for k, v in dims.items() if v is not None}
    total_w = sum(WEIGHTS[k] for k in present)
    index = sum(WEIGHTS[k] * v for k, v in present.items()) / total_w
    return MCBResult(round(dt, 2), round(ab, 2), round(no, 2), None if cc is None else round(cc, 2), round(mt, 2),
                     index=round(index, 2), tier=tier(index))
