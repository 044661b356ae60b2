"""``isagi eval tiers``: which tier the second query of a pair gets.

For each pair ``{"first", "second", "relation"}`` a fresh session takes the
first query (generating its reply, or storing a placeholder with
``generate=False``), then the second query is classified without generating.
Prints, per relation, the count of each tier, and the overall RETRIEVE
precision (RETRIEVE only on duplicate/paraphrase) and the RETRIEVE rate on
duplicates. Sessions here keep no history file and write no history rows.
"""

from __future__ import annotations

import json
from collections import Counter
from pathlib import Path
from typing import Any

from isagi.errors import InputError
from isagi.manifold.cog import Tier

RELATIONS = ("duplicate", "paraphrase", "near_miss", "related", "unrelated")
PLACEHOLDER = "(placeholder reply: evaluation without generation)"


def load_pairs_file(path: Path | None) -> list[dict[str, Any]]:
    if path is None:
        from isagi.data import load_pairs

        return load_pairs("test")
    rows = []
    try:
        lines = path.read_text(encoding="utf-8").splitlines()
    except OSError as exc:
        raise InputError(f"Cannot read the pairs file {path}: {exc.strerror}.") from exc
    for n, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            row = json.loads(line)
            if row["relation"] not in RELATIONS or not row["first"] or not row["second"]:
                raise ValueError
        except (ValueError, KeyError, TypeError):
            raise InputError(
                f"{path}:{n}: each line must be a JSON object with 'first', 'second' and "
                f"'relation' (one of {', '.join(RELATIONS)})."
            ) from None
        rows.append(row)
    return rows


def run(engine: Any, pairs: Path | None, *, generate: bool = False, progress: Any = None) -> dict[str, Any]:
    from isagi.engines.base import GenerationOptions

    rows = load_pairs_file(pairs)
    counts: dict[str, Counter[str]] = {r: Counter() for r in RELATIONS}
    examples: list[dict[str, Any]] = []
    options = GenerationOptions(max_new_tokens=48)
    for row in rows:
        session = engine.new_session(autosave=False)
        if generate:
            engine.turn(session, row["first"], options=options, record=False)
        else:
            engine.remember(session, row["first"], PLACEHOLDER)
        decision = engine.classify(session, row["second"])
        counts[row["relation"]][decision["tier"]] += 1
        examples.append({**row, **decision})
        if progress:
            progress(1)
    retrieved = sum(c[Tier.RETRIEVE.value] for c in counts.values())
    correct = counts["duplicate"][Tier.RETRIEVE.value] + counts["paraphrase"][Tier.RETRIEVE.value]
    n_dup = sum(counts["duplicate"].values())
    return {
        "pairs": len(rows),
        "generate": generate,
        "relations": {
            rel: {t.value: counts[rel][t.value] for t in Tier} for rel in RELATIONS if sum(counts[rel].values())
        },
        "retrieve_precision": round(correct / retrieved, 4) if retrieved else None,
        "duplicate_retrieve_rate": round(counts["duplicate"][Tier.RETRIEVE.value] / n_dup, 4) if n_dup else None,
        "violations": [
            e for e in examples
            if (e["relation"] in ("near_miss", "related", "unrelated") and e["tier"] == "RETRIEVE")
            or (e["relation"] == "unrelated" and e["tier"] == "AUGMENT")
            or (e["relation"] == "paraphrase" and e["tier"] == "EXPLORE")
        ][:20],
    }
