"""Progress callbacks: how long work reports how far it has got.

Owns one adapter. Long work (calibration, evaluations) reports to a
``progress(stage, done, total)`` callback, which the CLI draws as a rich
progress bar; the loops that do the work (an engine's prompt states, reply
generation) only know how many items they just finished. :func:`counter`
joins the two, so every stage's bar moves as each batch ends.
"""

from __future__ import annotations

from collections.abc import Callable

StageProgress = Callable[[str, int, int], None]


def counter(progress: StageProgress | None, stage: str, total: int) -> Callable[[int], None] | None:
    """A callback ``tick(n)`` that adds ``n`` done items and reports ``progress(stage, done, total)``;
    None when there is nothing to report to."""
    if progress is None:
        return None
    done = 0

    def tick(n: int) -> None:
        nonlocal done
        done += n
        progress(stage, done, total)

    return tick
