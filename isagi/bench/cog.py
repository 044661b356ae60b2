"""COG soak: a long synthetic life of the living manifold.

Behind ``isagi bench cog --interactions N --json`` (issue 3, item 8). Each
interaction is one query coordinate ``x`` drawn from a world of *shifting
clusters*: cluster centres random-walk, a new cluster appears every
``new_cluster_every`` interactions, and recent clusters are asked about more
often; a share of queries re-asks an earlier query (a noisy copy), as users do.

Per interaction, exactly as the turn pipeline does (docs/architecture.md, One turn):
lookup (two-stage, under the current metric) → tier from
:class:`~isagi.manifold.cog.TierThresholds` → RETRIEVE: count the hit; AUGMENT: count
the hit and a light update (``weight = 0.25``); EXPAND: full update, store the
trajectory in the nearest record's cluster; EXPLORE: full update, store it in
a new cluster. The memory's size cap is enforced by its own eviction. The soak
uses ``cap = 2000`` and ``exact_below = 1024`` by default so that one run goes
through the flat index, the switch to HNSW, drift rebuilds, eviction and
compaction (the product default ``exact_below`` is 4096).

Reported: the smallest eigenvalue of ``M`` over the whole run (checked after
every update) and whether ``M`` stayed exactly symmetric; per 1,000
interactions the growth ``‖M − I‖_F``, the saturation ``1 − λmin/λmax`` (see
:mod:`isagi.manifold.cog`), the mean growth per update, the tier counts and the memory
size; lookup p95 over the first and the last 1,000 interactions (index
rebuilds included: they happen inside ``search``); the resident set size at
the end (``VmRSS``) and its peak.
"""

from __future__ import annotations

import os
import resource
import time

import numpy as np

from isagi.manifold.cog import Metric, Tier, TierThresholds
from isagi.manifold.memory import TrajectoryMemory

__all__ = ["run"]

AUGMENT_WEIGHT = 0.25


def _status_mb(field: str) -> float | None:
    try:
        with open("/proc/self/status", encoding="ascii") as fh:
            for line in fh:
                if line.startswith(field + ":"):
                    return int(line.split()[1]) / 1024.0
    except OSError:
        pass
    return None


def _rss_mb() -> tuple[float, float]:
    """(current, peak) resident set size in MiB (``VmRSS``/``VmHWM``, else getrusage)."""
    peak_ru = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0
    cur = _status_mb("VmRSS")
    peak = _status_mb("VmHWM")
    return (cur if cur is not None else peak_ru), (peak if peak is not None else peak_ru)


class _World:
    """Shifting clusters in ``R^k`` and a history of asked queries."""

    def __init__(self, k: int, rng: np.random.Generator, start: int, noise: float) -> None:
        self.k = k
        self.rng = rng
        self.noise = noise
        self.centres = [rng.standard_normal(k) for _ in range(start)]
        self.asked: list[np.ndarray] = []

    def step(self, drift: float) -> None:
        for c in self.centres:
            c += drift * self.rng.standard_normal(self.k)

    def new_cluster(self) -> None:
        self.centres.append(self.rng.standard_normal(self.k))

    def query(self, repeat: float) -> np.ndarray:
        rng = self.rng
        if self.asked and rng.random() < repeat:
            base = self.asked[int(rng.integers(len(self.asked)))]
            x = base + 0.05 * self.noise * rng.standard_normal(self.k)
        else:
            z = len(self.centres)
            w = np.arange(1, z + 1, dtype=np.float64)  # recent clusters asked more
            c = self.centres[int(rng.choice(z, p=w / w.sum()))]
            x = c + self.noise * rng.standard_normal(self.k)
        self.asked.append(x)
        if len(self.asked) > 5000:
            self.asked = self.asked[-2500:]
        return x


def run(
    interactions: int = 10_000,
    k: int = 64,
    seed: int = 0,
    cap: int = 2_000,
    *,
    exact_below: int = 1024,
    start_clusters: int = 8,
    new_cluster_every: int = 100,
    repeat: float = 0.3,
    noise: float = 0.8,
    drift: float = 0.01,
    window: int = 1000,
) -> dict:
    """Run the soak; returns the figures as a JSON-ready dict."""
    if interactions < 1 or k < 1 or cap < 1:
        raise ValueError("interactions, k and cap must be at least 1")
    rng = np.random.default_rng(seed)
    world = _World(k, rng, start_clusters, noise)
    metric = Metric(k, window=window)
    memory = TrajectoryMemory(k, cap=cap, exact_below=exact_below)
    thresholds = TierThresholds()

    lat_ns = np.empty(interactions)
    min_eig = metric.min_eigenvalue
    symmetric = True
    max_len = 0
    growth: list[float] = []
    saturation: list[float] = []
    growth_rate: list[float] = []
    memory_sizes: list[int] = []
    tiers_per_window: list[dict[str, int]] = []
    counts = {t.value: 0 for t in Tier}
    t_run = time.perf_counter()

    for i in range(interactions):
        world.step(drift)
        if i and i % new_cluster_every == 0:
            world.new_cluster()
        x = world.query(repeat)

        t0 = time.perf_counter_ns()
        hits = memory.search(x, metric, top=1)
        lat_ns[i] = time.perf_counter_ns() - t0

        d = hits[0].distance if hits else float("nan")
        tier = thresholds.classify(d)
        counts[tier.value] += 1
        if tier is Tier.RETRIEVE:
            memory.record_hit(hits[0].id)
        elif tier is Tier.AUGMENT:
            memory.record_hit(hits[0].id)
            metric.update(x, weight=AUGMENT_WEIGHT)
        else:
            metric.update(x, weight=1.0)
            if tier is Tier.EXPAND:
                cluster = memory.get(hits[0].id)["cluster"]
            else:
                cluster = memory.next_cluster_id()
            memory.add(x, x, f"q{i}", f"r{i}", tier.value, cluster)
        if tier is not Tier.RETRIEVE:
            min_eig = min(min_eig, metric.min_eigenvalue)
            M = metric.M
            symmetric = symmetric and bool(np.array_equal(M, M.T))
        max_len = max(max_len, len(memory))

        if (i + 1) % window == 0 or i + 1 == interactions:
            growth.append(round(metric.growth, 6))
            saturation.append(round(metric.saturation, 6))
            growth_rate.append(round(metric.growth_rate, 8))
            memory_sizes.append(len(memory))
            tiers_per_window.append(dict(counts))
            counts = {t.value: 0 for t in Tier}

    lat_us = lat_ns / 1e3
    w = min(window, interactions)
    rss_now, rss_peak = _rss_mb()
    return {
        "interactions": int(interactions),
        "k": int(k),
        "min_eigenvalue": float(min_eig),
        "symmetric": symmetric,
        "growth": growth,
        "saturation": saturation,
        "growth_per_update": growth_rate,
        "tiers": tiers_per_window,
        "memory_sizes": memory_sizes,
        "memory_size": len(memory),
        "memory_max_size": int(max_len),
        "cap": int(cap),
        "evicted": int(memory.evicted),
        "index_rebuilds": int(memory.rebuilds),
        "metric_updates": int(metric.updates),
        "floor_events": int(metric.floor_events),
        "rss_mb_end": round(rss_now, 1),
        "rss_mb_peak": round(rss_peak, 1),
        "p95_us_start": round(float(np.percentile(lat_us[:w], 95)), 2),
        "p95_us_end": round(float(np.percentile(lat_us[-w:], 95)), 2),
        "p50_us_start": round(float(np.percentile(lat_us[:w], 50)), 2),
        "p50_us_end": round(float(np.percentile(lat_us[-w:], 50)), 2),
        "max_us": round(float(lat_us.max()), 2),
        "wall_s": round(time.perf_counter() - t_run, 2),
        "loadavg_1m": round(os.getloadavg()[0], 2),
        "seed": int(seed),
    }


if __name__ == "__main__":  # pragma: no cover - manual use
    import json
    import sys

    print(json.dumps(run(int(sys.argv[1]) if len(sys.argv) > 1 else 10_000), indent=2))
