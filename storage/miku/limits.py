"""The bounds of a ``.miku`` file, and how a refusal is worded.

A reader refuses anything larger than these bounds before allocating for it;
the writer checks the same bounds with the same functions
(:func:`storage.miku.scanner._scan`, :func:`storage.miku.budget._check_declared`,
:meth:`storage.miku.budget._Texts.count`) and refuses to write what a reader
would refuse. Why each bound is where it is: docs/miku-format.md, "Bounds".

Every other module of the package reads a bound as ``limits.NAME`` when it
checks it, never a copy made at import, so a bound changed here (a test lowers
one) is changed for the reader and the writer at once. The same names in
:mod:`storage.miku` are copies, for reading only.
"""

from __future__ import annotations

from isagi.errors import MikuError

# Turns: every turn costs work in proportion to the whole session, so a file
# holds a bounded number (a turn is a question and its reply, and stores at
# most one trajectory).
MAX_TURNS = 5_000
MAX_MESSAGES = 2 * MAX_TURNS  # a question and its reply per turn
MAX_TRAJECTORIES = MAX_TURNS  # a turn stores at most one
# Texts, counted at each use (at every message, trajectory row and message
# field that references a text of the string table), not once per text.
MAX_TEXT_CHARS = 64 * 1024**2
MAX_MIKU_BYTES = 64 * 1024**2  # 64 MiB: the largest .miku read, written or uploaded
MAX_STRINGS = 600_000  # distinct texts (a session has ~5 per turn)
MAX_MESSAGE_FIELDS = 32  # per-message fields besides role and text
MAX_META_ITEMS = 400_000  # msgpack objects in the meta (every nested item counts)
MAX_META_DEPTH = 24  # nesting of the meta (a tensor in extra settings is ~12)
# Memory: the Python objects a file declares are estimated from its counts,
# with the per-object costs below (measured under tracemalloc, rounded up),
# and refused above OBJECT_BUDGET_PER_FILE_BYTE * S + OBJECT_BUDGET_BYTES for a
# file of S bytes. Together with its arrays and texts:
#     peak memory of reading a file of S bytes <= 8 * S + 32 MiB
# (tests/test_miku_bombs.py measures it on bombs of every kind).
OBJECT_BUDGET_PER_FILE_BYTE = 3
OBJECT_BUDGET_BYTES = 32 * 1024**2
_COST_META_ITEM = 80  # one msgpack object of the meta (an empty map: ~74 bytes)
_COST_MESSAGE = 256  # one message dict with role and text (~216 bytes)
_COST_CELL = 48  # one more field in a message dict (~22-37 bytes)
_COST_STRING = 96  # one text of the string table, besides its characters (~75 bytes)
_COST_TEXT_ROW = 16  # one row of a trajectory text column (a list entry and an array entry)
MAX_STR_BYTES = 4 * 1024**2  # one string of the meta (a title, a v2.0 text): at most 4 MiB
MAX_LIST_LEN = MAX_META_ITEMS  # one list in the meta (v2.0 string lists, mixed fields)
MAX_MAP_LEN = 10_000  # keys in one map (tensor names, header fields, settings)
MAX_TENSOR_ELEMENTS = 2**31
MAX_NDIM = 8
MAX_NAME_LEN = 256
MAX_EXTRA_DEPTH = 8
MAX_RECORD_LEN = 1024


def _fail(where: str, what: str) -> MikuError:
    """The one exception of the format: where in the file, and what is wrong there."""
    return MikuError(f"{where}: {what}")


def _too_large(path: object, size: int) -> str:
    """Why a file (or a session about to be written) of ``size`` bytes is refused."""
    return (
        f"{path} is {size} bytes, larger than the limit of {MAX_MIKU_BYTES} bytes "
        f"({MAX_MIKU_BYTES // 1024**2} MiB) for a session file"
    )
