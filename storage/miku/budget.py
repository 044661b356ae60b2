"""What a meta declares it holds, against the limits and the memory budget of its file.

A file's counts (messages, trajectories, texts, message fields) and the
memory of the Python objects it declares are checked from the meta alone,
before any of them is built (:func:`_check_declared`); the characters of the
texts are counted at every reference to them as the references are validated
(:class:`_Texts`). The reader runs these on a file, the writer on the session
it is about to write, so what one refuses the other does, in the same words.
"""

from __future__ import annotations

import functools
from typing import NamedTuple

import numpy as np

from isagi.errors import MikuError
from isagi.storage.miku import limits
from isagi.storage.miku.limits import _fail
from isagi.storage.miku.validate import _is_int


def _object_budget(size: int) -> int:
    """The memory a file of ``size`` bytes may make its Python objects take (the memory bound: :mod:`storage.miku.limits`)."""
    return limits.OBJECT_BUDGET_PER_FILE_BYTE * size + limits.OBJECT_BUDGET_BYTES


def _check_items(items: int, size: int, where: str) -> int:
    """Refuse a meta of more msgpack objects than the budget of a file of ``size`` bytes; return ``items``."""
    if items * limits._COST_META_ITEM > _object_budget(size):
        raise _over_budget(where, items * limits._COST_META_ITEM, size)
    return items


def _over_budget(where: str, cost: int, size: int) -> MikuError:
    return _fail(
        where,
        f"reading it would take about {cost // 1024**2 + 1} MiB for its {size} bytes "
        f"(at most {_object_budget(size) // 1024**2} MiB for a file of this size): "
        "it declares far more objects than a session has",
    )


class _Declared(NamedTuple):
    """What a meta declares it holds, read from its counts and shapes alone."""

    messages: int
    trajectories: int
    strings: int
    fields: int
    cells: int  # message field values over all messages
    text_rows: int  # rows of the trajectory text columns over all of them


def _declared(payload: object) -> _Declared:
    """The counts an unchecked meta declares; what is malformed counts as nothing
    here and is refused by the structural checks that follow."""

    def count(node: object, key: str) -> int:
        v = node.get(key) if isinstance(node, dict) else None
        return v if _is_int(v) and v > 0 else 0

    def rows(node: object) -> int | None:
        shape = node.get("shape") if isinstance(node, dict) else None
        if isinstance(shape, list) and shape and _is_int(shape[0]) and shape[0] > 0:
            return shape[0]
        return None

    if not isinstance(payload, dict):
        return _Declared(0, 0, 0, 0, 0, 0)
    strings = payload.get("strings")
    conv = payload.get("conversation")
    n = count(conv, "n")
    fields = conv.get("fields") if isinstance(conv, dict) else None
    cells = 0
    if isinstance(fields, dict):
        for col in fields.values():
            r = rows(col.get("rows")) if isinstance(col, dict) else None
            cells += n if r is None else r
    traj = payload.get("trajectories")
    columns = traj.get("columns") if isinstance(traj, dict) else None
    texts = 0
    if isinstance(columns, dict):
        texts = sum(1 for c in columns.values() if isinstance(c, dict) and c.get("dtype") == "str")
    return _Declared(
        messages=n,
        trajectories=count(traj, "n"),
        strings=len(strings) if isinstance(strings, list) else count(strings, "n"),
        fields=len(fields) if isinstance(fields, dict) else 0,
        cells=cells,
        text_rows=texts * count(traj, "n"),
    )


def _check_declared(payload: object, meta_items: int, size: int) -> None:
    """Refuse a meta that declares more than a reader takes from a file of ``size`` bytes.

    The limits shared by reading and writing: the reader calls this on a
    file's meta before it reads the data area, the writer on the meta it is
    about to write, so what one refuses the other does, in the same words.
    Then the memory of the objects the meta declares (``meta_items`` msgpack
    objects, messages, message fields, texts), estimated before any is built,
    against the budget of the file's size.
    """
    d = _declared(payload)
    if d.messages > limits.MAX_MESSAGES:
        raise _fail(
            "conversation",
            f"{d.messages} messages, more than the limit of {limits.MAX_MESSAGES} "
            f"({limits.MAX_TURNS} turns of a question and its reply) for one session",
        )
    if d.trajectories > limits.MAX_TRAJECTORIES:
        raise _fail(
            "trajectories",
            f"{d.trajectories} rows, more than the limit of {limits.MAX_TRAJECTORIES} "
            f"(one per turn, {limits.MAX_TURNS} turns) for one session",
        )
    if d.strings > limits.MAX_STRINGS:
        raise _fail("strings", f"{d.strings} texts, more than the limit of {limits.MAX_STRINGS}")
    if d.fields > limits.MAX_MESSAGE_FIELDS:
        raise _fail(
            "conversation", f"{d.fields} message fields, more than the limit of {limits.MAX_MESSAGE_FIELDS}"
        )
    cost = (
        meta_items * limits._COST_META_ITEM
        + d.strings * limits._COST_STRING
        + d.messages * limits._COST_MESSAGE
        + d.cells * limits._COST_CELL
        + d.text_rows * limits._COST_TEXT_ROW
    )
    if cost > _object_budget(size):
        raise _over_budget("contents", cost, size)


class _Texts:
    """The string table, and the characters its references add up to (MAX_TEXT_CHARS).

    Each index tensor that refers to the table (a trajectory text column, the
    messages' roles and texts, a text-valued message field) is counted by
    :meth:`count` as it is validated, before anything is built from it: the
    characters of the text each row refers to, at every row. The reader counts
    a file's tensors, the writer the session's, with this one method.
    """

    def __init__(self, table: list[str]) -> None:
        self.table = table
        self.sizes = np.fromiter(map(len, table), dtype=np.int64, count=len(table))
        self.used = 0

    @functools.cached_property
    def objects(self) -> np.ndarray:
        """The table as an object array: a text column is then one fancy-indexing call."""
        return np.fromiter(self.table, dtype=object, count=len(self.table))

    def count(self, where: str, idx: np.ndarray) -> None:
        """Check that ``idx`` points into the table; add the characters it refers to."""
        if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= len(self.sizes)):
            raise _fail(where, f"index points outside the string table of {len(self.sizes)} entries")
        self.used += int(self.sizes[idx].sum())
        if self.used > limits.MAX_TEXT_CHARS:
            raise _fail(
                where,
                f"its texts add up to more than {limits.MAX_TEXT_CHARS} characters, the limit for one "
                "session (a text is counted at every message or row that holds it)",
            )


