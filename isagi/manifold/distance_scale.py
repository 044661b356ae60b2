"""The per-model distance scale: where the tier boundaries lie for this model.

Owns the calibrated, monotone rescaling of the metric distance that docs/architecture.md
(Definitions: distance) allows. The seed thresholds (RETRIEVE < 0.05, AUGMENT < 0.20, EXPAND < 0.50)
are kept on the rescaled distance; the rescaling is a piecewise-linear map
whose knots come from the project's own calibration pairs
(``isagi/data/pairs_calibration.jsonl``, never the held-out test pairs):

- 0.20 (AUGMENT | EXPAND) sits at 0.9 × the smallest unrelated-pair distance,
  so unrelated questions are not treated as related;
- 0.50 (EXPAND | EXPLORE) sits at 1.1 × the largest paraphrase-pair distance,
  so a paraphrase never seeds a new cluster.

RETRIEVE is not decided by geometry: on SmolLM2-135M duplicates spread over
0.00–0.68 in the centred UGT frame while near misses sit at 0.00–0.12, so the
exact sameness check decides, and ``retrieve_cap`` (1.25 × the largest
duplicate-pair distance) only bounds how far a same-content record may lie.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any

import numpy as np


@dataclass(frozen=True)
class DistanceScale:
    augment_at: float  # raw distance mapped to 0.20
    explore_at: float  # raw distance mapped to 0.50
    retrieve_cap: float  # largest raw distance at which a same-content record is retrieved
    report: dict[str, Any]

    def rescale(self, d: float) -> float:
        """Monotone map of the raw metric distance onto the seed thresholds' scale."""
        xs = [0.0, self.augment_at / 4, self.augment_at, self.explore_at, max(2.0, self.explore_at + 1e-6)]
        ys = [0.0, 0.05, 0.20, 0.50, 1.0]
        return float(np.interp(d, xs, ys))

    def to_state(self) -> dict[str, Any]:
        return asdict(self)

    @classmethod
    def from_state(cls, state: dict[str, Any]) -> DistanceScale:
        return cls(float(state["augment_at"]), float(state["explore_at"]), float(state["retrieve_cap"]),
                   dict(state.get("report", {})))


SEED = DistanceScale(augment_at=0.20, explore_at=0.50, retrieve_cap=0.05, report={"calibrated": False})


def calibrate(distances: dict[str, np.ndarray]) -> DistanceScale:
    """Knots from per-relation pair distances (metric-free cosine in the UGT frame)."""
    unrelated_min = float(np.min(distances["unrelated"]))
    paraphrase_max = float(np.max(distances["paraphrase"]))
    duplicate_max = float(np.max(distances["duplicate"]))
    augment_at = 0.9 * unrelated_min
    explore_at = max(1.1 * paraphrase_max, augment_at * 1.01)
    report = {"calibrated": True, "pairs": {k: len(v) for k, v in distances.items()}}
    report.update({f"{k}_range": [float(np.min(v)), float(np.max(v))] for k, v in distances.items()})
    return DistanceScale(augment_at, explore_at, 1.25 * duplicate_max, report)


def calibrate_on_pairs(lm: Any, layer: int, basis: Any, system_prompt: str) -> DistanceScale:
    """Run the calibration pairs through the model and fit the scale."""
    from isagi.data import load_pairs
    from isagi.manifold.pooling import prompt_hidden_states
    from isagi.manifold.ugt import project

    rows = load_pairs("calibration")

    def chats(key: str) -> list[list[dict[str, str]]]:
        return [[{"role": "system", "content": system_prompt}, {"role": "user", "content": r[key]}] for r in rows]

    a = project(basis, prompt_hidden_states(lm, chats("first"), layer))
    b = project(basis, prompt_hidden_states(lm, chats("second"), layer))
    cos = np.sum(a * b, axis=1) / (np.linalg.norm(a, axis=1) * np.linalg.norm(b, axis=1) + 1e-12)
    d = 1.0 - cos
    by_rel: dict[str, list[float]] = {}
    for r, v in zip(rows, d, strict=True):
        by_rel.setdefault(r["relation"], []).append(float(v))
    return calibrate({k: np.array(v) for k, v in by_rel.items()})
