"""Greedy paths of the real model checked against one evaluation of their own tokens.

llama.cpp evaluates a batch of tokens with other kernels than a single token, and a shifted
cache holds rotated keys, so two ways to reach the same context round differently: their
logits agree to a fraction of a logit. Where two tokens nearly tie, greedy decoding may then
take either, and which one depends on the CPU's kernels (seen on a CPU without AVX-512, where
a reply cut and continued went on "gentle soul" and the reply decoded in one go "hardworking
man"; docs/measurements.md, "Greedy paths and rounding"). A test that a path is the greedy
path of a context therefore states: every token is the argmax of one evaluation of the
context and the tokens before it, up to :data:`ROUNDING` logits; and where two such paths
part, both tokens are within :data:`ROUNDING` of the top. A wrong context (a token missing,
the turn closed and reopened) misses by whole logits.
"""

from __future__ import annotations

import numpy as np

#: how far, in logits, a greedy token may lie under the top of another evaluation of the same
#: tokens and still count as its argmax: a near-tie, not a different context (the rounding
#: measured is several times smaller; a wrong context misses by several logits)
ROUNDING = 1.0


def _gaps(rows: np.ndarray, path: list[int]) -> np.ndarray:
    return rows.max(axis=1) - rows[np.arange(len(path)), path]


def slack(lm, messages: list[dict[str, str]], path: list[int]) -> np.ndarray:
    """For each token of ``path`` after ``messages``: the top logit minus the token's own logit,
    from one evaluation of the prompt and the whole path (0 where the token is the argmax)."""
    return _gaps(lm.reply_logits(messages, path), path)


def assert_greedy(lm, messages: list[dict[str, str]], path: list[int], other: list[int] | None = None) -> None:
    """``path`` is the greedy path after ``messages`` up to rounding; and if ``other`` (another
    greedy path of the same context) parts from it, it does so at a near-tie of the two tokens
    (read from the same evaluation: up to the parting the two paths hold the same tokens)."""
    rows = lm.reply_logits(messages, path)
    gaps = _gaps(rows, path)
    assert gaps.max() <= ROUNDING, (lm.detokenize(path), gaps.round(3).tolist())
    if other is None or other[: len(path)] == path[: len(other)]:
        return
    k = next(i for i, (a, b) in enumerate(zip(path, other, strict=False)) if a != b)
    row = rows[k]
    assert row.max() - row[other[k]] <= ROUNDING, (
        f"the paths part at token {k} where {lm.detokenize([other[k]])!r} lies "
        f"{row.max() - row[other[k]]:.3f} logits under the top: not a near-tie",
        lm.detokenize(path), lm.detokenize(other))
