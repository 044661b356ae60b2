"""A session file's contents in memory: :class:`MikuState`, and a new file's header.

This is what the writer takes and the reader returns; it holds arrays, text
columns, messages and settings, and checks nothing itself (the writer
validates a state before it writes it, the reader a file before it builds
one).
"""

from __future__ import annotations

import datetime as _dt
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from isagi.storage.miku.frame import FORMAT_VERSION


@dataclass
class MikuState:
    """Everything a ``.miku`` file holds, in memory."""

    header: dict[str, Any]
    tensors: dict[str, np.ndarray] = field(default_factory=dict)
    trajectories: dict[str, np.ndarray | list[str]] = field(default_factory=dict)
    conversation: list[dict[str, Any]] = field(default_factory=list)
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def n_trajectories(self) -> int:
        """Number of rows in the trajectory columns (0 when there are none)."""
        for col in self.trajectories.values():
            return len(col)
        return 0


def new_header(
    *,
    model_id: str,
    model_fingerprint: str,
    d: int,
    k: int,
    layer: int,
    isagi_version: str | None = None,
    **extra: Any,
) -> dict[str, Any]:
    """A valid v2 header stamped with the current time and ISAGI version."""
    if isagi_version is None:
        from isagi import __version__ as isagi_version
    return {
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.now(_dt.UTC).isoformat(timespec="seconds"),
        "isagi_version": isagi_version,
        "model_id": model_id,
        "model_fingerprint": model_fingerprint,
        "d": d,
        "k": k,
        "layer": layer,
        **extra,
    }


def raw_size(state: MikuState) -> int:
    """Bytes of the state's arrays and UTF-8 texts, without any framing."""
    total = sum(int(a.nbytes) for a in state.tensors.values())
    for col in state.trajectories.values():
        if isinstance(col, np.ndarray):
            total += int(col.nbytes)
        else:
            total += sum(len(s.encode("utf-8")) for s in col)
    for msg in state.conversation:
        total += sum(len(v.encode("utf-8")) for v in msg.values() if isinstance(v, str))
    return total
