"""The ``.miku`` v2 session file: one self-describing, checksummed file.

This module owns the on-disk format of a saved session and nothing else: it
knows about headers, typed tensors, column-wise trajectories, a conversation
log and a small settings dict, but not what a metric or a basis *means*. The
research code pickled a PyTorch blob next to a JSON file (anyone who handed a
user a file could run code on their machine) and wrote it in place; this
format cannot execute code, is written atomically and is read strictly.

Frame (all integers little-endian)::

    offset 0   8 bytes   MAGIC = b"\\x89MIKU\\r\\n\\x1a"
    offset 8   uint16    format version, major (2)
    offset 10  uint16    format version, minor (1 written; 0 and 1 read)
    offset 12  uint32    length L of the checksum record
    offset 16  L bytes   msgpack map {"algo": "crc32" | "blake2b" | "sha256", "digest": bin}
    offset 16+L ...EOF   payload; the checksum covers exactly it

(Version 2.0 files stored the version as one uint32 = 2, which reads as major
2, minor 0, so both are told apart by the same 4 bytes.)

Payload of v2.1 (written by this version)::

    uint32 M | M bytes: the meta, one msgpack map | the data area, to EOF

Every array lives in the data area as raw little-endian bytes; the meta says
where (TENSOR below). Every byte of the data area belongs to exactly one
tensor, and tensors are stored back to back (the session's own arrays first,
then what only rebuilds texts and messages), so a reader reads each one
straight into an array of its own, in one pass, hashing as it goes.

Payload of v2.0 (read only): one msgpack map with the same sections, tensors
carrying their bytes inline ({"dtype", "shape", "data": bin}) and "strings" a
plain msgpack list of str.

Meta map (every key required, no others)::

    "header":       {format_version: int (2), created: ISO-8601 str, isagi_version: str,
                     model_id: str, model_fingerprint: str, d: int, k: int,
                     layer: int, + optional extra scalar fields}
    "tensors":      {name: TENSOR}
    "strings":      {"n": int, "groups": [GROUP, ...]}  the string table
    "trajectories": {"n": int N, "columns": {name: TENSOR with shape[0] == N
                                             | {"dtype": "str", "index": TENSOR}}}
    "conversation": {"n": int M, "role": {"dtype": "str", "index": TENSOR},
                     "text": {"dtype": "str", "index": TENSOR},
                     "fields": {name: {"rows": nil | TENSOR int,
                                       "values": TENSOR | {"dtype": "str", "index": ...}
                                                 | [scalar]}}}
    "extra":        JSON-like dict (scalars, lists, nested dicts; bounded depth)

    TENSOR = {"dtype": one of DTYPES, "shape": [int, ...], "offset": int}
             bytes [offset, offset + size) of the data area, C order,
             little-endian; bool one byte per element, 0 or 1
    GROUP  = {"encoding": "latin-1" | "utf-8", "count": int, "sep": str | nil,
              "lengths": nil | TENSOR int, "data": TENSOR uint8}

Texts (trajectory text columns, message roles and texts) live once in the
string table and are referenced by int32/int64 index tensors: a user message
and the query of its trajectory are the same string, so it is stored and
decoded once. The table is stored in groups by the widest character of each
text (Latin-1 only, up to U+FFFF, beyond), so that each group decodes in one
call into one Python string of one width and is cut into its ``count`` texts
by a separator character that occurs in none of them (``sep``), or, when every
candidate occurs, by the texts' lengths in characters (``lengths``). Latin-1
texts are stored as Latin-1 (one byte per character), the others as UTF-8.
A group holds about 256K characters, so the string it decodes into stays in
cache while it is cut. The groups come in the order of the table, which the
index tensors refer to. Decoding texts one by one from UTF-8 (v2.0) was most
of the load time.

Other per-message fields (time, tier, ...) are stored as columns: the rows
that have the field (nil when every message has it) and its values in row
order, as a float64/int64/bool tensor or string-table index when they all
share that type, else as a list of scalars. A message that lacks a field reads
back without it, ``None`` reads back ``None``, and every value keeps its
Python type.

The checksum guards against accidental damage (bit rot, truncation, a torn
copy); it is not a signature (anyone who edits a file can recompute any
unkeyed digest). CRC-32 (zlib, digest big-endian) is the default: it detects
every error burst up to 32 bits and any other damage with probability
1 - 2**-32, and is the cheapest named checksum available here (measured
against SHA-256 and BLAKE2b: docs/measurements.md); BLAKE2b and
SHA-256 are still written on request and read.

Reading, in this order: refuses a file over MAX_MIKU_BYTES; verifies the
checksum over the whole payload, in small pieces, before parsing anything of
it; scans the msgpack meta without building it (every object counted, a
container's items as soon as its header declares them, nesting, string and
map lengths, declared lengths checked against the bytes left); refuses a
meta that declares more messages, trajectories, texts or message fields than
the limits below, or objects whose estimated memory exceeds its budget;
checks that the tensors tile the data area; only then reads arrays and builds
objects, counting the characters of every text at each place that uses it
before the column or the messages that use it are built. The rules:

- reading a file of S bytes peaks below 8 * S + 32 MiB (see the bounds
  below; measured by tests/test_miku_bombs.py), v2.0 and v2.1 alike;
- what it returns holds at most MAX_TURNS turns (MAX_MESSAGES messages,
  MAX_TRAJECTORIES trajectories), so a loaded session answers its next turn
  within a bounded cost;
- its texts, each counted at every message, trajectory row and message field
  that uses it, add up to at most MAX_TEXT_CHARS characters, besides the
  strings of the meta itself (at most S bytes): a text stored once and used
  many times counts many times, so whatever handles each message or row once
  (the page, the history store, an export) handles a bounded amount of text,
  however the file shares its texts.

It validates every field, never unpickles, and raises exactly one exception
type, :class:`isagi.errors.MikuError`, whose message says what is wrong.
Writing runs the same checks (the same functions, in the same order) on what
it is about to write and writes nothing a reader would refuse, so a file this
module writes is always one it can read back. What the values *mean* (a
positive definite metric, ...) is checked by :mod:`isagi.session.files`.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import functools
import gc
import hashlib
import io
import math
import os
import re
import struct
import sys
import tempfile
import time
import warnings
import zlib
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO, NamedTuple

import msgpack
import numpy as np

from isagi.errors import MikuError, StorageError

MAGIC = b"\x89MIKU\r\n\x1a"
FORMAT_VERSION = 2  # major: the header's format_version
FORMAT_MINOR = 1  # written; minors 0 and 1 are read
_PREFIX = struct.Struct("<8sHHI")  # magic, major, minor, checksum record length
_META_LEN = struct.Struct("<I")

# Named checksum algorithms a reader accepts (name -> digest size in bytes).
CHECKSUM_ALGOS: dict[str, int] = {"crc32": 4, "blake2b": 64, "sha256": 32}
DEFAULT_CHECKSUM = "crc32"

# dtype name -> little-endian numpy dtype. Nothing else is ever decoded.
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int8": np.dtype("i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
_NATIVE_LE = sys.byteorder == "little"

# Bounds. A reader refuses anything larger before allocating for it; the writer
# checks the same limits with the same functions (_scan, _check_declared,
# _Texts.count) and refuses to write what a reader would refuse.
#
# Turns. Every turn of a session costs work in proportion to the whole of it:
# the autosave rewrites its file, and the page renders every message again and
# redraws the growth, TEH and trajectory-map plots over all turns. So a loaded
# session answers its next turn within a bounded cost only if its length is
# bounded: a file may hold at most MAX_TURNS turns (a turn is a question and
# its reply, and stores at most one trajectory). At this many turns that work
# is already a noticeable part of a turn; at a few times as many it is more
# than the turn itself (docs/measurements.md, "Session limits").
MAX_TURNS = 5_000
MAX_MESSAGES = 2 * MAX_TURNS  # a question and its reply per turn
MAX_TRAJECTORIES = MAX_TURNS  # a turn stores at most one
# Texts, counted at each use. A text is stored once in the string table and
# referenced by every message, trajectory row and message field that holds it,
# so a file of one long text referenced many times holds little but is the
# conversation of all those references to whatever handles each message once
# (the page, the history store, an export). The reader counts the characters
# of each referenced text at every reference while it validates the
# references, before any column or message is built, and refuses a file whose
# total exceeds MAX_TEXT_CHARS: no file expands into more text than a file of
# the largest size holding every text once. A real session references its
# texts about twice (a question is its message, its trajectory's query and
# key) and is far below.
MAX_TEXT_CHARS = 64 * 1024**2
MAX_MIKU_BYTES = 64 * 1024**2  # 64 MiB: the largest .miku read, written or uploaded
MAX_STRINGS = 600_000  # distinct texts (a session has ~5 per turn)
MAX_MESSAGE_FIELDS = 32  # per-message fields besides role and text
MAX_META_ITEMS = 400_000  # msgpack objects in the meta (every nested item counts)
MAX_META_DEPTH = 24  # nesting of the meta (a tensor in extra settings is ~12)
# Memory. Reading a file of S bytes allocates its arrays (at most S bytes in
# all), the texts decoded from them (at most ~4 bytes per byte, for texts in
# the widest group) and Python objects: the meta's, one dict per message, one
# entry per message field, one str per text of the string table. Their number
# is declared by the file and costs far more than the bytes declaring them (an
# empty msgpack map: 1 byte -> ~74 bytes; a message of two shared texts: 8
# bytes -> ~216), so the reader estimates their memory from the declared counts,
# before building any of them, with the per-object costs below (measured under
# tracemalloc, rounded up), and refuses a file whose estimate exceeds
# OBJECT_BUDGET_PER_FILE_BYTE * S + OBJECT_BUDGET_BYTES. Together:
#     peak memory of reading a file of S bytes <= 8 * S + 32 MiB
# (tests/test_miku_bombs.py measures it on bombs of every kind). A real session
# is far below (docs/measurements.md).
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
_WRITE_CHUNK = 8 * 1024**2
_HASH_CHUNK = 512 * 1024  # read and hash in pieces that fit in L2

# Text groups: (largest code point, encoding). Separators are tried in order.
_TEXT_GROUPS = ((0xFF, "latin-1"), (0xFFFF, "utf-8"), (0x10FFFF, "utf-8"))
_ENCODINGS = frozenset(enc for _, enc in _TEXT_GROUPS)
_SEPARATORS = tuple(map(chr, range(32)))
_TEXT_BATCH = 256 * 1024  # characters per text group (see _batches)

_HEADER_REQUIRED: dict[str, type] = {
    "format_version": int,
    "created": str,
    "isagi_version": str,
    "model_id": str,
    "model_fingerprint": str,
    "d": int,
    "k": int,
    "layer": int,
}
_PAYLOAD_KEYS = frozenset({"header", "strings", "tensors", "trajectories", "conversation", "extra"})
_TENSOR_KEYS = frozenset({"dtype", "shape", "offset"})
_GROUP_KEYS = frozenset({"encoding", "count", "sep", "lengths", "data"})
_SCALARS = (str, int, float, bool, type(None))
_SCALAR_TYPES = frozenset(_SCALARS)


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


# --------------------------------------------------------------------------- validation


def _fail(where: str, what: str) -> MikuError:
    return MikuError(f"{where}: {what}")


def _is_int(v: object) -> bool:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_name(where: str, name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > MAX_NAME_LEN:
        raise _fail(
            where,
            f"invalid name {name!r} (a non-empty string of at most {MAX_NAME_LEN} characters)",
        )
    return name


def _check_map(where: str, obj: object) -> dict:
    if not isinstance(obj, dict):
        raise _fail(where, f"expected a map, found {type(obj).__name__}")
    if len(obj) > MAX_MAP_LEN:
        raise _fail(where, f"a map of {len(obj)} entries, more than the limit of {MAX_MAP_LEN}")
    return obj


def _check_header(header: object, where: str = "header") -> dict[str, Any]:
    header = _check_map(where, header)
    for key, typ in _HEADER_REQUIRED.items():
        if key not in header:
            raise _fail(where, f"missing field {key!r}")
        val = header[key]
        ok = _is_int(val) if typ is int else isinstance(val, typ)
        if not ok:
            raise _fail(where, f"field {key!r} must be {typ.__name__}, found {type(val).__name__}")
    if header["format_version"] != FORMAT_VERSION:
        raise _fail(
            where,
            f"format version {header['format_version']} is not supported (this ISAGI reads version {FORMAT_VERSION})",
        )
    for key in ("d", "k"):
        if not 1 <= header[key] <= 1_000_000:
            raise _fail(where, f"field {key!r} = {header[key]} is out of range 1..1000000")
    if not -10_000 <= header["layer"] <= 10_000:
        raise _fail(where, f"field 'layer' = {header['layer']} is out of range")
    try:
        _dt.datetime.fromisoformat(header["created"])
    except ValueError:
        raise _fail(
            where, f"field 'created' = {header['created'][:64]!r} is not an ISO-8601 time"
        ) from None
    for key, val in header.items():
        _check_name(where, key)
        if key not in _HEADER_REQUIRED and not isinstance(val, _SCALARS):
            raise _fail(where, f"extra field {key!r} must be a scalar, found {type(val).__name__}")
        if isinstance(val, float) and not math.isfinite(val):
            raise _fail(where, f"field {key!r} is not finite")
    return header


def _check_extra(obj: object, where: str, depth: int = 0) -> None:
    if depth > MAX_EXTRA_DEPTH:
        raise _fail(where, f"nested deeper than {MAX_EXTRA_DEPTH} levels")
    if isinstance(obj, _SCALARS):
        return
    if isinstance(obj, list):
        if len(obj) > MAX_LIST_LEN:
            raise _fail(where, f"list of {len(obj)} items, more than {MAX_LIST_LEN}")
        for i, v in enumerate(obj):
            _check_extra(v, f"{where}[{i}]", depth + 1)
        return
    if isinstance(obj, dict):
        _check_map(where, obj)
        for k, v in obj.items():
            _check_name(where, k)
            _check_extra(v, f"{where}.{k}", depth + 1)
        return
    raise _fail(
        where, f"unsupported value of type {type(obj).__name__} (scalars, lists and maps only)"
    )


def _check_message(i: int, msg: object) -> dict[str, Any]:
    where = f"conversation[{i}]"
    msg = _check_map(where, msg)
    for key in ("role", "text"):
        if not isinstance(msg.get(key), str):
            raise _fail(
                where, f"field {key!r} must be a string, found {type(msg.get(key)).__name__}"
            )
    for key, val in msg.items():
        _check_name(where, key)
        if not isinstance(val, _SCALARS):
            raise _fail(where, f"field {key!r} must be a scalar, found {type(val).__name__}")
    return msg


def _check_conversation(conv: object) -> list[dict[str, Any]]:
    if not isinstance(conv, list):
        raise _fail("conversation", f"expected a list of messages, found {type(conv).__name__}")
    for i, msg in enumerate(conv):
        _check_message(i, msg)
    return conv


def _check_shape_against_header(name: str, arr: np.ndarray, header: dict, n: int | None) -> None:
    d, k = header["d"], header["k"]
    expected = {"metric": (k, k), "basis": (d, k), "mu": (d,)}.get(name)
    if n is not None and name in ("query_x", "reply_x"):
        expected = (n, k)
    if expected is not None and arr.shape != expected:
        raise _fail(
            f"{name}",
            f"shape {list(arr.shape)} does not match header d={d}, k={k} (expected {list(expected)})",
        )


# --------------------------------------------------------------------------- encode


class _Hasher:
    """One interface over zlib.crc32 and hashlib (update with buffers, then digest)."""

    def __init__(self, algo: str) -> None:
        self.algo = algo
        self._crc = 0
        self._h = None if algo == "crc32" else hashlib.new(algo)

    def update(self, data: Any) -> None:
        if self._h is None:
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._h.update(data)

    def digest(self) -> bytes:
        if self._h is None:
            return self._crc.to_bytes(4, "big")
        return self._h.digest()


class _DataArea:
    """The v2.1 data area being written: tensors back to back, meta gets offsets."""

    def __init__(self) -> None:
        self.chunks: list[bytes] = []
        self.size = 0

    def tensor(self, where: str, arr: object) -> dict[str, Any]:
        if not isinstance(arr, np.ndarray):
            raise _fail(where, f"expected a numpy array, found {type(arr).__name__}")
        name = arr.dtype.name
        if name not in DTYPES or arr.dtype.kind not in "fiub":
            raise _fail(where, f"dtype {arr.dtype} is not supported (allowed: {', '.join(DTYPES)})")
        desc = {"dtype": name, "shape": list(arr.shape), "offset": self.size}
        _check_descriptor(where, desc, _TENSOR_KEYS)  # the reader's check of its shape
        # a copy: the file's bytes are a snapshot even if the caller's array changes
        data = np.ascontiguousarray(arr, dtype=DTYPES[name]).tobytes()
        self.chunks.append(data)
        self.size += len(data)
        return desc


class _Refs(NamedTuple):
    """What the writer counts as the reader will: the string table and each index into it."""

    table: list[str]
    indices: list[tuple[str, np.ndarray]]  # (where, as the reader names it; table indices)


def _encode_payload(state: MikuState, area: _DataArea) -> tuple[dict[str, Any], _Refs]:
    """The v2.1 meta for ``state`` and its text references; arrays go to ``area``.

    Validates every field first (with the reader's checks). The limits a
    reader puts on the whole are checked on the result, by :func:`_encode_parts`.
    """
    if not isinstance(state, MikuState):
        raise _fail("state", f"expected a MikuState, found {type(state).__name__}")
    header = _check_header(dict(state.header))
    for name, arr in _check_map("tensors", state.tensors).items():
        _check_name("tensors", name)
        if isinstance(arr, np.ndarray):
            _check_shape_against_header(name, arr, header, None)
    n = state.n_trajectories
    table: dict[str, int] = {}
    text_cols: dict[str, np.ndarray] = {}  # column name -> table indices (before grouping)
    for name, col in _check_map("trajectories", state.trajectories).items():
        _check_name("trajectories", name)
        where = f"trajectories[{name!r}]"
        if isinstance(col, np.ndarray):
            if col.ndim == 0 or col.shape[0] != n:
                raise _fail(
                    where, f"has {col.shape[0] if col.ndim else 0} rows, other columns have {n}"
                )
            _check_shape_against_header(name, col, header, n)
        elif isinstance(col, list | tuple):
            if len(col) != n:
                raise _fail(where, f"has {len(col)} rows, other columns have {n}")
            for i, s in enumerate(col):
                if not isinstance(s, str):
                    raise _fail(where, f"row {i} must be a string, found {type(s).__name__}")
            text_cols[name] = _intern(table, col)
        else:
            raise _fail(
                where, f"expected a numpy array or a list of strings, found {type(col).__name__}"
            )
    conversation = _check_conversation(list(state.conversation))
    extra = _check_map("extra", state.extra)
    _check_extra(extra, "extra")
    conv = _conversation_columns(conversation, table)
    # the references as the reader meets them: trajectory columns, roles, texts, fields
    refs = _Refs(list(table), [(f"trajectories[{k!r}]", v) for k, v in text_cols.items()])
    refs.indices.append(("conversation.role", conv["role"]))
    refs.indices.append(("conversation.text", conv["text"]))
    for key, (_, kind, values) in conv["fields"].items():
        if kind == "str":
            refs.indices.append((f"conversation.fields[{key!r}]", values))

    # the session's own arrays first, then what only rebuilds texts and messages
    tensors = {name: area.tensor(f"tensors[{name!r}]", arr) for name, arr in state.tensors.items()}
    columns: dict[str, Any] = {
        name: None if name in text_cols else area.tensor(f"trajectories[{name!r}]", col)
        for name, col in state.trajectories.items()
    }
    strings, remap = _encode_strings(refs.table, area)

    def index(idx: np.ndarray) -> dict[str, Any]:
        dtype = np.int32 if len(table) < 2**31 else np.int64
        return {"dtype": "str", "index": area.tensor("string index", remap[idx].astype(dtype))}

    for name, idx in text_cols.items():
        columns[name] = index(idx)
    fields = {}
    for key, (rows, kind, values) in conv["fields"].items():
        if kind == "str":
            encoded: Any = index(values)
        elif kind == "tensor":
            encoded = area.tensor(key, values)
        else:
            encoded = values  # mixed types: a plain list of scalars
        fields[key] = {"rows": None if rows is None else area.tensor(key, rows), "values": encoded}
    meta = {
        "header": header,
        "strings": strings,
        "tensors": tensors,
        "trajectories": {"n": n, "columns": columns},
        "conversation": {
            "n": conv["n"],
            "role": index(conv["role"]),
            "text": index(conv["text"]),
            "fields": fields,
        },
        "extra": extra,
    }
    return meta, refs


def _intern(table: dict[str, int], texts: list[str]) -> np.ndarray:
    setdefault = table.setdefault
    return np.fromiter((setdefault(t, len(table)) for t in texts), dtype=np.int64, count=len(texts))


def _conversation_columns(conv: list[dict[str, Any]], table: dict[str, int]) -> dict[str, Any]:
    fields: dict[str, tuple[list[int], list[Any]]] = {}
    for i, msg in enumerate(conv):
        for key, val in msg.items():
            if key != "role" and key != "text":
                rows, values = fields.setdefault(key, ([], []))
                rows.append(i)
                values.append(val)
    n = len(conv)
    out: dict[str, Any] = {
        "n": n,
        "role": _intern(table, [m["role"] for m in conv]),
        "text": _intern(table, [m["text"] for m in conv]),
        "fields": {},
    }
    for key, (rows, values) in fields.items():
        # None: every message has the field (the common case)
        row_arr = None if len(rows) == n else np.asarray(rows, np.int64)
        kinds = set(map(type, values))
        col: Any = values  # mixed types (None among numbers, ...): a plain list
        kind = "list"
        if kinds == {str}:
            kind, col = "str", _intern(table, values)
        elif kinds == {float}:
            kind, col = "tensor", np.asarray(values, dtype=np.float64)
        elif kinds == {bool}:
            kind, col = "tensor", np.asarray(values, dtype=np.bool_)
        elif kinds == {int} and min(values) >= -(2**63) and max(values) < 2**63:
            kind, col = "tensor", np.asarray(values, dtype=np.int64)
        out["fields"][key] = (row_arr, kind, col)
    return out


def _widest_chars(strings: list[str]) -> np.ndarray:
    """The largest code point of each string (0 for empty ones), vectorised."""
    out = np.zeros(len(strings), np.uint32)
    wide = [i for i, s in enumerate(strings) if not s.isascii()]
    if wide:
        texts = [strings[i] for i in wide]
        lens = np.fromiter(map(len, texts), np.int64, len(texts))
        # surrogatepass: a lone surrogate is classified here and refused by the encoder
        code = np.frombuffer("".join(texts).encode("utf-32-le", "surrogatepass"), "<u4")
        starts = np.cumsum(lens) - lens
        out[wide] = np.maximum.reduceat(code, starts)  # non-ASCII texts are never empty
    ascii_ = np.ones(len(strings), bool)
    ascii_[wide] = False
    if ascii_.any():
        out[ascii_] = 0x7F
    return out


def _encode_strings(strings: list[str], area: _DataArea) -> tuple[dict[str, Any], np.ndarray]:
    """Group the string table by character width; return its meta and old -> new positions."""
    widest = _widest_chars(strings)
    group_of = np.searchsorted(np.array([lim for lim, _ in _TEXT_GROUPS]), widest)
    order = np.argsort(group_of, kind="stable")
    remap = np.empty(len(strings), np.int64)
    remap[order] = np.arange(len(strings), dtype=np.int64)
    counts = np.bincount(group_of, minlength=len(_TEXT_GROUPS))
    groups = []
    start = 0
    for (_, encoding), count in zip(_TEXT_GROUPS, counts.tolist(), strict=True):
        texts = [strings[i] for i in order[start : start + count].tolist()]
        start += count
        for batch in _batches(texts):
            groups.append(_encode_group(batch, encoding, area))
    return {"n": len(strings), "groups": groups}, remap


def _batches(texts: list[str]) -> list[list[str]]:
    """Consecutive runs of about _TEXT_BATCH characters (a longer text is a run of its own).

    Decoding a group makes one string of all its texts and cuts it; a group
    small enough for that string to stay in cache decodes markedly faster.
    """
    out: list[list[str]] = []
    begin, size = 0, 0
    for i, n in enumerate(map(len, texts)):
        if size and size + n > _TEXT_BATCH:
            out.append(texts[begin:i])
            begin, size = i, 0
        size += n + 1
    if begin < len(texts):
        out.append(texts[begin:])
    return out


def _encode_group(texts: list[str], encoding: str, area: _DataArea) -> dict[str, Any]:
    joined = "".join(texts)
    sep = next((c for c in _SEPARATORS if c not in joined), None)
    lengths = None
    if sep is not None:
        joined = sep.join(texts)
    else:  # every candidate separator occurs: cut by lengths instead
        lengths = np.fromiter(map(len, texts), np.int64, len(texts))
    try:
        data = joined.encode(encoding)
    except UnicodeEncodeError as exc:
        raise _fail("strings", f"session cannot be encoded: {exc}") from None
    return {
        "encoding": encoding,
        "count": len(texts),
        "sep": sep,
        "lengths": None if lengths is None else area.tensor("lengths", lengths),
        "data": area.tensor("text", np.frombuffer(data, np.uint8)),
    }


def _encode_parts(state: MikuState, checksum: str) -> list[bytes]:
    """The file as a list of byte strings (prefix + record, meta, data area chunks)."""
    if checksum not in CHECKSUM_ALGOS:
        raise MikuError(
            f"checksum algorithm {checksum!r} is not supported (use one of {sorted(CHECKSUM_ALGOS)})"
        )
    area = _DataArea()
    meta, refs = _encode_payload(state, area)
    try:
        meta_bytes = msgpack.packb(meta, use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise MikuError(f"session cannot be encoded: {exc}") from None
    parts = [_META_LEN.pack(len(meta_bytes)) + meta_bytes, *area.chunks]
    size = _PREFIX.size + len(_record(checksum, bytes(CHECKSUM_ALGOS[checksum])))
    size += sum(map(len, parts))
    # what a reader would refuse is not written: the reader's checks, in its order
    try:
        if size > MAX_MIKU_BYTES:
            raise MikuError(_too_large("it", size))
        items = _check_items(_scan(meta_bytes, "meta"), size, "meta")
        _check_declared(meta, items, size)
        texts = _Texts(refs.table)
        for where, idx in refs.indices:
            texts.count(where, idx)
    except MikuError as exc:
        raise MikuError(
            f"the session cannot be saved: a reader would refuse it ({exc}); start a new session"
        ) from None
    hasher = _Hasher(checksum)
    for part in parts:
        hasher.update(part)
    record = _record(checksum, hasher.digest())
    return [_PREFIX.pack(MAGIC, FORMAT_VERSION, FORMAT_MINOR, len(record)) + record, *parts]


def _record(algo: str, digest: bytes) -> bytes:
    """The checksum record (its length depends on the algorithm only)."""
    return msgpack.packb({"algo": algo, "digest": digest}, use_bin_type=True)


def encode_miku(state: MikuState, *, checksum: str = DEFAULT_CHECKSUM) -> bytes:
    """The complete bytes of a ``.miku`` v2.1 file for ``state`` (validated first)."""
    return b"".join(_encode_parts(state, checksum))


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view[:_WRITE_CHUNK])
        if written <= 0:  # pragma: no cover - os.write raises instead
            raise OSError(errno.EIO, "write returned no progress")
        view = view[written:]


def write_miku(
    path: str | os.PathLike[str], state: MikuState, *, checksum: str = DEFAULT_CHECKSUM
) -> None:
    """Save ``state`` to ``path`` atomically.

    The bytes go to a temporary file ``.NAME.XXXX.tmp`` in the same
    directory, which is fsynced and then renamed over ``path`` (and the
    directory fsynced), so a crash or a full disk at any moment leaves either
    the old file or the new one, never a mix. On an OS error the temporary
    file is removed, the old file is untouched, and :class:`StorageError`
    says what happened. A save that is killed cannot remove its temporary
    file: the next save of the same ``path`` removes those left for a minute
    or more, and :func:`remove_stale_temp_files` removes all of a directory's
    (for a server at start).
    """
    path = Path(path)
    parts = _encode_parts(state, checksum)
    parent = path.parent if str(path.parent) else Path(".")
    tmp: str | None = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        remove_stale_temp_files(parent, older_than_s=60.0, name=path.name)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
        try:
            with contextlib.suppress(OSError):
                os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else 0o600)
            for part in parts:
                _write_all(fd, part)
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
        tmp = None
        _fsync_dir(parent)
    except OSError as exc:
        hint = ""
        if exc.errno in (errno.ENOSPC, errno.EDQUOT):
            hint = " The disk is full: free some space and save again."
        elif exc.errno in (errno.EACCES, errno.EPERM, errno.EROFS):
            hint = " Check that the directory is writable."
        raise StorageError(
            f"Could not save the session to {path}: {exc.strerror or exc}.{hint} "
            "The previous file (if any) is unchanged."
        ) from exc
    finally:
        if tmp is not None:  # failed or interrupted before the rename
            with contextlib.suppress(OSError):
                os.unlink(tmp)


_STALE_TEMP = re.compile(r"\..+\.miku\.[A-Za-z0-9_]+\.tmp")


def remove_stale_temp_files(
    directory: str | os.PathLike[str], *, older_than_s: float = 60.0, name: str | None = None
) -> list[Path]:
    """Remove what killed saves left in ``directory``; return the removed paths.

    Only files named as :func:`write_miku` names its temporary files
    (``.NAME.miku.XXXX.tmp``, of the file ``name`` only when given) and
    unchanged for ``older_than_s`` seconds (a save takes well under a second,
    so one in progress elsewhere is left alone) are removed; a directory that
    does not exist has none.
    """
    removed: list[Path] = []
    now = time.time()
    try:
        entries = list(os.scandir(directory))
    except FileNotFoundError:
        return removed
    except OSError as exc:
        raise StorageError(f"Could not list {directory}: {exc.strerror or exc}") from exc
    for entry in entries:
        if not _STALE_TEMP.fullmatch(entry.name) or not entry.is_file(follow_symlinks=False):
            continue
        if name is not None and not entry.name.startswith(f".{name}."):
            continue
        with contextlib.suppress(OSError):
            if now - entry.stat(follow_symlinks=False).st_mtime >= older_than_s:
                os.unlink(entry.path)
                removed.append(Path(entry.path))
    return removed


def _fsync_dir(directory: Path) -> None:
    try:
        dfd = os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))
    except OSError:  # pragma: no cover - e.g. platforms without directory fds
        return
    try:
        with contextlib.suppress(OSError):
            os.fsync(dfd)
    finally:
        os.close(dfd)


# --------------------------------------------------------------------------- decode


@functools.cache
def _msgpack_kinds() -> tuple[tuple[int, int], ...]:
    """For each first byte of a msgpack object: (kind, n).

    kind 0: a scalar of n bytes in all; 1: str/bin with an n-byte length;
    2: array with an n-byte count; 3: map with an n-byte count; 4: fixarray,
    5: fixmap, 6: fixstr (n = the low bits hold the size); -1: refused
    (extension types, the unused 0xc1).
    """
    kinds = [(-1, 0)] * 256
    for b in range(0x80):
        kinds[b] = (0, 1)  # positive fixint
    for b in range(0xE0, 0x100):
        kinds[b] = (0, 1)  # negative fixint
    for b in range(0x80, 0x90):
        kinds[b] = (5, 0)
    for b in range(0x90, 0xA0):
        kinds[b] = (4, 0)
    for b in range(0xA0, 0xC0):
        kinds[b] = (6, 0)
    for b in (0xC0, 0xC2, 0xC3):
        kinds[b] = (0, 1)  # nil, false, true
    for b, n in ((0xCA, 5), (0xCB, 9), (0xCC, 2), (0xCD, 3), (0xCE, 5), (0xCF, 9)):
        kinds[b] = (0, n)  # float32/64, uint8..64
    for b, n in ((0xD0, 2), (0xD1, 3), (0xD2, 5), (0xD3, 9)):
        kinds[b] = (0, n)  # int8..64
    for b, n in ((0xC4, 1), (0xC5, 2), (0xC6, 4), (0xD9, 1), (0xDA, 2), (0xDB, 4)):
        kinds[b] = (1, n)  # bin8/16/32, str8/16/32
    kinds[0xDC], kinds[0xDD] = (2, 2), (2, 4)
    kinds[0xDE], kinds[0xDF] = (3, 2), (3, 4)
    return tuple(kinds)


def _scan(buf: bytes, where: str) -> int:
    """Check one msgpack object's structure without building any of it.

    Counts every object (a container's declared items count as soon as its
    header is read, before any of them), bounds the total by MAX_META_ITEMS,
    the nesting by MAX_META_DEPTH, a string by MAX_STR_BYTES and a map by
    MAX_MAP_LEN (a list is bounded by the total), and checks that every
    declared length fits in the bytes that are left. Only then may ``msgpack``
    build objects (its own limits are the same, as a second guard):
    what it builds is bounded by the counts checked here, not by what a
    small file can declare (a few bytes per empty map made ~72 bytes each).
    Returns the number of objects.
    """
    kinds = _msgpack_kinds()
    end = len(buf)
    pos = 0
    items = 1
    stack = [1]  # objects still to read in each open container
    from_bytes = int.from_bytes
    while stack:
        if not stack[-1]:
            stack.pop()
            continue
        stack[-1] -= 1
        if pos >= end:
            raise _fail(where, "not valid msgpack (truncated)")
        b = buf[pos]
        kind, n = kinds[b]
        if kind == 0:
            pos += n
            continue
        if kind == 6:
            pos += 1 + (b & 0x1F)
            continue
        if kind == 1:
            size = from_bytes(buf[pos + 1 : pos + 1 + n], "big")
            pos += 1 + n + size
            if pos > end:
                raise _fail(where, f"not valid msgpack (a {size}-byte string or blob does not fit)")
            if size > MAX_STR_BYTES and b >= 0xD9:  # str8/16/32 (a blob fits in a file)
                raise _fail(where, f"a string of {size} bytes, more than the limit of {MAX_STR_BYTES}")
            continue
        if kind == 4 or kind == 5:
            count = (b & 0x0F) * (2 if kind == 5 else 1)
            pos += 1
        elif kind == 2 or kind == 3:
            count = from_bytes(buf[pos + 1 : pos + 1 + n], "big") * (2 if kind == 3 else 1)
            pos += 1 + n
        else:
            raise _fail(where, f"not valid msgpack (type byte 0x{b:02x} is not allowed)")
        if count:
            items += count
            if items > MAX_META_ITEMS:
                raise _fail(where, f"holds more than {MAX_META_ITEMS} items")
            if count > end - pos:
                raise _fail(where, f"not valid msgpack ({count} items declared, {end - pos} bytes left)")
            if len(stack) >= MAX_META_DEPTH:
                raise _fail(where, f"nested deeper than {MAX_META_DEPTH} levels")
            if (kind == 3 or kind == 5) and count > 2 * MAX_MAP_LEN:
                raise _fail(where, f"a map of {count // 2} entries, more than the limit of {MAX_MAP_LEN}")
            stack.append(count)
    if pos != end:
        raise _fail(where, f"not valid msgpack ({end - pos} bytes after the end)" if pos < end else "not valid msgpack (truncated)")
    return items


def _object_budget(size: int) -> int:
    """The memory a file of ``size`` bytes may make its Python objects take (see the bound above)."""
    return OBJECT_BUDGET_PER_FILE_BYTE * size + OBJECT_BUDGET_BYTES


def _check_items(items: int, size: int, where: str) -> int:
    """Refuse a meta of more msgpack objects than the budget of a file of ``size`` bytes; return ``items``."""
    if items * _COST_META_ITEM > _object_budget(size):
        raise _over_budget(where, items * _COST_META_ITEM, size)
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
    if d.messages > MAX_MESSAGES:
        raise _fail(
            "conversation",
            f"{d.messages} messages, more than the limit of {MAX_MESSAGES} "
            f"({MAX_TURNS} turns of a question and its reply) for one session",
        )
    if d.trajectories > MAX_TRAJECTORIES:
        raise _fail(
            "trajectories",
            f"{d.trajectories} rows, more than the limit of {MAX_TRAJECTORIES} "
            f"(one per turn, {MAX_TURNS} turns) for one session",
        )
    if d.strings > MAX_STRINGS:
        raise _fail("strings", f"{d.strings} texts, more than the limit of {MAX_STRINGS}")
    if d.fields > MAX_MESSAGE_FIELDS:
        raise _fail(
            "conversation", f"{d.fields} message fields, more than the limit of {MAX_MESSAGE_FIELDS}"
        )
    cost = (
        meta_items * _COST_META_ITEM
        + d.strings * _COST_STRING
        + d.messages * _COST_MESSAGE
        + d.cells * _COST_CELL
        + d.text_rows * _COST_TEXT_ROW
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
        if self.used > MAX_TEXT_CHARS:
            raise _fail(
                where,
                f"its texts add up to more than {MAX_TEXT_CHARS} characters, the limit for one "
                "session (a text is counted at every message or row that holds it)",
            )


def _unpack(buf: bytes, where: str) -> Any:
    """Scan, then build, one msgpack object."""
    _scan(buf, where)
    return _build(buf, where)


def _build(buf: bytes, where: str) -> Any:
    """Build a msgpack object already checked by :func:`_scan`."""
    try:
        return msgpack.unpackb(
            buf,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=MAX_MIKU_BYTES,
            max_array_len=MAX_LIST_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises ValueError, TypeError, UnicodeDecodeError, ...
        raise _fail(where, f"not valid msgpack ({type(exc).__name__}: {str(exc)[:200]})") from None


def _check_descriptor(where: str, obj: object, keys: frozenset) -> tuple[np.dtype, list[int]]:
    """Validate a tensor's dtype and shape (and its key set); return (dtype, shape)."""
    obj = _check_map(where, obj)
    if obj.keys() != keys:
        raise _fail(
            where,
            f"tensor fields must be {', '.join(sorted(keys))}; found {sorted(map(str, obj))}",
        )
    dtype_name, shape = obj["dtype"], obj["shape"]
    if not isinstance(dtype_name, str) or dtype_name not in DTYPES:
        raise _fail(where, f"dtype {str(dtype_name)[:40]!r} is not one of {', '.join(DTYPES)}")
    if not isinstance(shape, list) or len(shape) > MAX_NDIM:
        raise _fail(where, f"shape must be a list of at most {MAX_NDIM} sizes")
    count = 1
    for s in shape:
        if not _is_int(s) or s < 0 or s > MAX_TENSOR_ELEMENTS:
            raise _fail(where, f"shape {str(shape)[:80]} has an invalid size {str(s)[:40]}")
        count *= s
    if count > MAX_TENSOR_ELEMENTS:
        raise _fail(where, f"shape {shape} has {count} elements, more than {MAX_TENSOR_ELEMENTS}")
    return DTYPES[dtype_name], shape


def _check_bool(where: str, arr: np.ndarray) -> None:
    if arr.dtype == np.bool_ and arr.size and int(arr.view(np.uint8).max()) > 1:
        raise _fail(where, "bool tensor holds bytes other than 0 and 1")


class _Inline:
    """v2.0: tensors carry their bytes in the msgpack payload; strings are a msgpack list."""

    _KEYS = frozenset({"dtype", "shape", "data"})

    def tensor(self, where: str, obj: object) -> np.ndarray:
        dtype, shape = _check_descriptor(where, obj, self._KEYS)
        data = obj["data"]  # type: ignore[index]
        count = math.prod(shape)
        if not isinstance(data, bytes):
            raise _fail(where, f"data must be bytes, found {type(data).__name__}")
        if len(data) != count * dtype.itemsize:
            raise _fail(
                where,
                f"data is {len(data)} bytes, shape {shape} of {dtype.name} needs {count * dtype.itemsize}",
            )
        arr = np.frombuffer(data, dtype=dtype).reshape(shape)
        _check_bool(where, arr)
        return arr.astype(dtype.newbyteorder("="), copy=True)

    def strings(self, obj: object) -> list[str]:
        if not isinstance(obj, list):
            raise _fail("strings", f"expected a list of strings, found {type(obj).__name__}")
        if len(obj) > MAX_STRINGS:
            raise _fail("strings", f"{len(obj)} texts, more than the limit {MAX_STRINGS}")
        if not all(type(t) is str for t in obj):
            bad = next(i for i, t in enumerate(obj) if type(t) is not str)
            raise _fail("strings", f"entry {bad} is a {type(obj[bad]).__name__}, not a string")
        return obj


class _Loaded:
    """v2.1: tensors were read from the data area (keyed by their descriptor)."""

    def __init__(self, arrays: dict[int, np.ndarray]) -> None:
        self.arrays = arrays

    def tensor(self, where: str, obj: object) -> np.ndarray:
        _check_descriptor(where, obj, _TENSOR_KEYS)
        arr = self.arrays.get(id(obj))
        if arr is None:  # pragma: no cover - every descriptor of these sections is planned
            raise _fail(where, "tensor is not in the data area")
        _check_bool(where, arr)
        return arr

    def strings(self, obj: object) -> list[str]:
        obj = _check_map("strings", obj)
        if obj.keys() != {"n", "groups"}:
            raise _fail("strings", "fields must be n and groups")
        n, groups = obj["n"], obj["groups"]
        if not _is_int(n) or not 0 <= n <= MAX_STRINGS:
            raise _fail("strings", f"string count {str(n)[:40]} is invalid (at most {MAX_STRINGS})")
        if not isinstance(groups, list):
            raise _fail("strings", f"groups must be a list, found {type(groups).__name__}")
        out: list[str] = []
        for i, group in enumerate(groups):
            out += self._group(f"strings.groups[{i}]", group, n - len(out))
        if len(out) != n:
            raise _fail("strings", f"groups hold {len(out)} strings, the table declares {n}")
        return out

    def _group(self, where: str, group: object, room: int) -> list[str]:
        group = _check_map(where, group)
        if group.keys() != _GROUP_KEYS:
            raise _fail(where, f"fields must be {', '.join(sorted(_GROUP_KEYS))}")
        encoding, count, sep = group["encoding"], group["count"], group["sep"]
        if not isinstance(encoding, str) or encoding not in _ENCODINGS:
            raise _fail(
                where, f"encoding {str(encoding)[:40]!r} is not one of {sorted(_ENCODINGS)}"
            )
        if not _is_int(count) or not 1 <= count <= room:
            raise _fail(where, f"count {str(count)[:40]} is invalid")
        if (sep is None) == (group["lengths"] is None):
            raise _fail(where, "exactly one of sep and lengths must be given")
        if sep is not None and (not isinstance(sep, str) or len(sep) != 1):
            raise _fail(where, "sep must be one character")
        data = self.tensor(f"{where}.data", group["data"])
        if data.dtype != np.uint8 or data.ndim != 1:
            raise _fail(where, "data must be a uint8 vector")
        try:
            text = str(data, encoding)
        except UnicodeDecodeError as exc:
            raise _fail(where, f"texts are not valid {encoding} ({exc.reason})") from None
        if sep is not None:
            parts = text.split(sep, count)
            if len(parts) != count:
                raise _fail(where, f"holds {len(parts)} texts, expected {count}")
            return parts
        lengths = self.tensor(f"{where}.lengths", group["lengths"])
        if lengths.dtype.kind != "i" or lengths.shape != (count,):
            raise _fail(where, f"lengths must be a signed integer vector of {count}")
        # each in 0..len(text) first: the sum cannot overflow, the cuts never overlap
        if int(lengths.min()) < 0 or int(lengths.max()) > len(text):
            raise _fail(where, "a length is outside the group's text")
        ends = np.cumsum(lengths, dtype=np.int64)
        if int(ends[-1]) != len(text):
            raise _fail(where, "lengths do not add up to the group's text")
        starts = ends - lengths
        return list(map(text.__getitem__, map(slice, starts.tolist(), ends.tolist())))


_Decoder = _Inline | _Loaded


def _own(arr: np.ndarray) -> np.ndarray:
    """The array itself if it owns its memory, else a copy (never a view of a file buffer)."""
    return arr if arr.flags.owndata else arr.copy()


def _decode_payload(payload: object, dec: _Decoder) -> MikuState:
    payload = _check_map("payload", payload)
    keys = set(payload)
    if keys != _PAYLOAD_KEYS:
        missing, unknown = _PAYLOAD_KEYS - keys, keys - _PAYLOAD_KEYS
        raise _fail(
            "payload",
            f"missing sections {sorted(missing)}, unknown sections {sorted(map(str, unknown))}",
        )
    header = _check_header(payload["header"])
    strings = _Texts(dec.strings(payload["strings"]))
    tensors = {}
    for name, obj in _check_map("tensors", payload["tensors"]).items():
        _check_name("tensors", name)
        arr = dec.tensor(f"tensors[{name!r}]", obj)
        _check_shape_against_header(name, arr, header, None)
        tensors[name] = _own(arr)
    traj = _check_map("trajectories", payload["trajectories"])
    if set(traj) != {"n", "columns"}:
        raise _fail("trajectories", "fields must be n and columns")
    n = traj["n"]
    if not _is_int(n) or not 0 <= n <= MAX_TRAJECTORIES:  # the count is checked by _check_declared
        raise _fail("trajectories", f"row count {str(n)[:40]} is invalid")
    trajectories: dict[str, np.ndarray | list[str]] = {}
    for name, obj in _check_map("trajectories.columns", traj["columns"]).items():
        _check_name("trajectories", name)
        where = f"trajectories[{name!r}]"
        if isinstance(obj, dict) and obj.get("dtype") == "str":
            trajectories[name] = _decode_texts(where, obj, strings, n, dec)
        else:
            arr = dec.tensor(where, obj)
            if arr.ndim == 0 or arr.shape[0] != n:
                raise _fail(where, f"has {arr.shape[0] if arr.ndim else 0} rows, expected {n}")
            _check_shape_against_header(name, arr, header, n)
            trajectories[name] = _own(arr)
    if not trajectories and n != 0:
        raise _fail("trajectories", f"declares {n} rows but has no columns")
    conversation = _decode_conversation(payload["conversation"], strings, dec)
    extra = _check_map("extra", payload["extra"])
    _check_extra(extra, "extra")
    return MikuState(
        header=header,
        tensors=tensors,
        trajectories=trajectories,
        conversation=conversation,
        extra=extra,
    )


def _decode_texts(where: str, obj: object, strings: _Texts, n: int, dec: _Decoder) -> list[str]:
    return _text_array(where, obj, strings, n, dec).tolist()


def _text_array(where: str, obj: object, strings: _Texts, n: int, dec: _Decoder) -> np.ndarray:
    """A text column as an object array of the string table's own str objects.

    Its index is validated and counted (:meth:`_Texts.count`) before the
    column is built.
    """
    obj = _check_map(where, obj)
    if set(obj) != {"dtype", "index"} or obj["dtype"] != "str":
        raise _fail(where, "a text column must have exactly dtype='str' and an index tensor")
    idx = dec.tensor(f"{where}.index", obj["index"])
    if idx.dtype.kind not in "iu" or idx.shape != (n,):
        raise _fail(
            where,
            f"index must be an integer vector of {n} rows, found {idx.dtype} {list(idx.shape)}",
        )
    strings.count(where, idx)
    return strings.objects[idx]


def _decode_conversation(obj: object, strings: _Texts, dec: _Decoder) -> list[dict[str, Any]]:
    obj = _check_map("conversation", obj)
    if set(obj) != {"n", "role", "text", "fields"}:
        raise _fail("conversation", "fields must be n, role, text and fields")
    n = obj["n"]
    if not _is_int(n) or not 0 <= n <= MAX_MESSAGES:  # the count is checked by _check_declared
        raise _fail("conversation", f"message count {str(n)[:40]} is invalid")
    roles = _text_array("conversation.role", obj["role"], strings, n, dec)
    texts = _text_array("conversation.text", obj["text"], strings, n, dec)
    columns: list[tuple[str, list[int] | None, list[Any]]] = []
    fields = _check_map("conversation.fields", obj["fields"])
    if len(fields) > MAX_MESSAGE_FIELDS:  # checked by _check_declared
        raise _fail("conversation", f"{len(fields)} message fields, more than {MAX_MESSAGE_FIELDS}")
    for key, col in fields.items():
        _check_name("conversation.fields", key)
        where = f"conversation.fields[{key!r}]"
        if key in ("role", "text"):
            raise _fail(where, "duplicates a required field")
        col = _check_map(where, col)
        if set(col) != {"rows", "values"}:
            raise _fail(where, "must have exactly rows and values")
        rows = None
        if col["rows"] is not None:
            rows = dec.tensor(f"{where}.rows", col["rows"])
            if rows.dtype.kind not in "iu" or rows.ndim != 1:
                raise _fail(where, "rows must be an integer vector")
            if rows.size and (
                int(rows[0]) < 0
                or int(rows[-1]) >= n
                or (rows.size > 1 and bool((np.diff(rows) <= 0).any()))
            ):
                raise _fail(
                    where, "rows must be increasing message numbers within the conversation"
                )
        count = n if rows is None else int(rows.shape[0])
        values = _decode_values(where, col["values"], strings, count, dec)
        columns.append((key, rows, values))
    # one pass builds each message with the first field every message has (the
    # dicts are too many to stay in cache for a second pass); the rest are added
    full = next((c for c in columns if c[1] is None), None)
    if full is None:
        conv = [{"role": r, "text": t} for r, t in zip(roles, texts, strict=True)]
    else:
        key = full[0]
        conv = [
            {"role": r, "text": t, key: v} for r, t, v in zip(roles, texts, full[2], strict=True)
        ]
    for key, rows, values in columns:
        if rows is None:
            if key == full[0]:  # type: ignore[index]
                continue
            targets = conv
        elif rows.size > 1 and bool((np.diff(rows) == rows[1] - rows[0]).all()):
            # evenly spaced rows (every assistant message, ...): a slice
            targets = conv[int(rows[0]) : int(rows[-1]) + 1 : int(rows[1] - rows[0])]
        else:
            targets = list(map(conv.__getitem__, rows.tolist()))
        for msg, v in zip(targets, values, strict=True):
            msg[key] = v
    return conv


def _decode_values(
    where: str, obj: object, strings: _Texts, count: int, dec: _Decoder
) -> list[Any]:
    if isinstance(obj, list):
        if len(obj) != count:
            raise _fail(where, f"has {len(obj)} values for {count} rows")
        if not all(type(v) in _SCALAR_TYPES for v in obj):
            bad = next(v for v in obj if type(v) not in _SCALAR_TYPES)
            raise _fail(where, f"values must be scalars, found {type(bad).__name__}")
        return obj
    if isinstance(obj, dict) and obj.get("dtype") == "str":
        return _decode_texts(where, obj, strings, count, dec)
    arr = dec.tensor(where, obj)
    if arr.dtype.name not in ("float64", "int64", "bool") or arr.shape != (count,):
        raise _fail(
            where,
            f"values must be a float64/int64/bool vector of {count}, found {arr.dtype} {list(arr.shape)}",
        )
    return arr.tolist()


# --------------------------------------------------------------------------- reading a file


def _read_exact(f: BinaryIO, n: int, what: str) -> bytes:
    data = f.read(n) if n else b""
    if len(data) != n:
        raise MikuError(f"is truncated ({what} ends after {len(data)} of {n} bytes)")
    return data


def _read_into(f: BinaryIO, buf: memoryview) -> None:
    """Fill ``buf`` from ``f``."""
    got, size = 0, len(buf)
    while got < size:
        n = f.readinto(buf[got:])
        if not n:
            raise MikuError(f"is truncated (the data area ends {size - got} bytes early)")
        got += n


def _hash_rest(f: BinaryIO, hasher: _Hasher) -> int:
    """Hash ``f`` from where it is to its end, one cache-sized piece at a time; return the bytes read."""
    buf = bytearray(_HASH_CHUNK)
    view = memoryview(buf)
    total = 0
    while n := f.readinto(view):
        hasher.update(view[:n])
        total += n
    return total


class _Span(NamedTuple):
    offset: int
    nbytes: int
    desc: dict
    dtype: np.dtype
    shape: list[int]


def _plan(meta: object, data_len: int) -> list[_Span]:
    """Find and validate every tensor descriptor of the v2.1 meta; check they tile the data area.

    Returns the spans in file order. Nothing is allocated here: sizes are
    checked against the data area's real length first.
    """
    meta = _check_map("meta", meta)
    spans: list[_Span] = []

    def walk(node: Any, where: str, depth: int) -> None:
        if depth > MAX_EXTRA_DEPTH:
            return  # nothing legitimate is this deep; the structural check refuses it
        if type(node) is dict:
            if node.keys() == _TENSOR_KEYS:
                dtype, shape = _check_descriptor(where, node, _TENSOR_KEYS)
                offset = node["offset"]
                if not _is_int(offset) or not 0 <= offset <= data_len:
                    raise _fail(where, f"offset {str(offset)[:40]} is outside the data area")
                nbytes = math.prod(shape) * dtype.itemsize
                spans.append(_Span(offset, nbytes, node, dtype, shape))
                return
            for key, value in node.items():
                if type(value) is dict or type(value) is list:
                    walk(value, f"{where}.{key}", depth + 1)
        else:
            for i, value in enumerate(node):
                if type(value) is dict:
                    walk(value, f"{where}[{i}]", depth + 1)

    for section in ("tensors", "strings", "trajectories", "conversation"):
        node = meta.get(section)
        if type(node) is dict or type(node) is list:
            walk(node, section, 0)
    spans.sort(key=lambda s: (s.offset, s.nbytes))
    pos = 0
    for span in spans:
        if span.offset != pos:
            raise _fail(
                "data area",
                f"a tensor starts at byte {span.offset}, the previous one ends at {pos}",
            )
        pos += span.nbytes
        if pos > data_len:
            raise _fail("data area", f"tensors need more than its {data_len} bytes")
    if pos != data_len:
        raise _fail("data area", f"{data_len} bytes, but the tensors cover {pos}")
    return spans


def _read_spans(f: BinaryIO, spans: list[_Span]) -> dict[int, np.ndarray]:
    """Read each tensor of the data area straight into its own (writable) array."""
    arrays: dict[int, np.ndarray] = {}
    for span in spans:
        arr = np.empty(span.shape, dtype=span.dtype)
        if span.nbytes:
            _read_into(f, memoryview(arr.reshape(-1).view(np.uint8)))
        if not _NATIVE_LE and span.dtype.itemsize > 1:  # pragma: no cover - big-endian hosts
            arr = arr.astype(span.dtype.newbyteorder("="))
        arrays[id(span.desc)] = arr
    return arrays


def _version_text(major: int, minor: int) -> str:
    return f"{major}" if minor == 0 else f"{major}.{minor}"


def _load(
    f: BinaryIO, size: int, path: Path, *, verify: bool = True
) -> tuple[MikuState, str, bool]:
    """Read a whole .miku from ``f`` (``size`` bytes): (state, checksum algo, checksum ok).

    With ``verify`` a checksum mismatch raises; without it (``inspect``) the
    state is still returned when the contents parse.
    """
    head = f.read(_PREFIX.size)
    if len(head) < _PREFIX.size:
        raise MikuError(f"{path} is not a .miku file (only {len(head)} bytes; truncated or empty)")
    magic, major, minor, rec_len = _PREFIX.unpack(head)
    if magic != MAGIC:
        if (head + f.read(48)).lstrip()[:1] in (b"{", b"["):
            raise MikuError(
                f"{path} looks like a legacy v1 (JSON) .miku file; convert it with `isagi import-legacy`"
            )
        raise MikuError(f"{path} is not a .miku file (wrong magic bytes)")
    if major != FORMAT_VERSION:
        raise MikuError(
            f"{path} has format version {_version_text(major, minor)}; "
            f"this ISAGI reads version {FORMAT_VERSION}"
        )
    if minor > FORMAT_MINOR:
        raise MikuError(
            f"{path} has format version {major}.{minor}, newer than this ISAGI reads "
            f"({FORMAT_VERSION}.{FORMAT_MINOR}); update ISAGI to open it"
        )
    if rec_len > MAX_RECORD_LEN or _PREFIX.size + rec_len > size:
        raise MikuError(f"{path} is truncated or corrupted (checksum record length {rec_len})")
    record = _unpack(f.read(rec_len), f"{path}: checksum record")
    if not isinstance(record, dict) or set(record) != {"algo", "digest"}:
        raise MikuError(f"{path}: checksum record must have exactly algo and digest")
    algo, digest = record["algo"], record["digest"]
    if not isinstance(algo, str) or algo not in CHECKSUM_ALGOS:
        raise MikuError(f"{path}: checksum algorithm {str(algo)[:40]!r} is not supported")
    if not isinstance(digest, bytes) or len(digest) != CHECKSUM_ALGOS[algo]:
        raise MikuError(f"{path}: checksum digest has the wrong type or length for {algo}")
    payload_start = _PREFIX.size + rec_len
    payload_len = size - payload_start
    # the checksum first, over the whole payload, in small pieces: nothing of
    # the payload is parsed, decoded or allocated for before it is known
    hasher = _Hasher(algo)
    if _hash_rest(f, hasher) != payload_len:
        raise MikuError(f"{path} changed size while it was read; try again")
    ok = hasher.digest() == digest
    if verify and not ok:
        raise MikuError(f"{path} is corrupted: the {algo} checksum does not match its contents")
    f.seek(payload_start)

    def invalid(exc: Exception) -> MikuError:
        why = "nested too deeply" if isinstance(exc, RecursionError) else str(exc)
        status = "" if verify else f" (checksum {'ok' if ok else 'mismatch'})"
        return MikuError(f"{path} is invalid{status}: {why}")

    gc_was_enabled = gc.isenabled()
    try:
        dec: _Decoder
        if minor == 0:
            raw = _read_exact(f, payload_len, "the payload")
            items = _check_items(_scan(raw, "payload"), size, "payload")
            meta: Any = _build(raw, "payload")
            del raw
        else:
            meta_len = _META_LEN.unpack(_read_exact(f, _META_LEN.size, "the meta length"))[0]
            if meta_len > payload_len - _META_LEN.size:
                raise MikuError(f"is truncated (meta of {meta_len} bytes does not fit)")
            raw = _read_exact(f, meta_len, "the meta")
            items = _check_items(_scan(raw, "meta"), size, "meta")
            meta = _build(raw, "meta")
            del raw
        # the counts it declares and the memory of every object it declares,
        # before any is built (the writer checks what it writes the same way)
        _check_declared(meta, items, size)
        if minor == 0:
            dec = _Inline()
        else:
            spans = _plan(meta, payload_len - _META_LEN.size - meta_len)
            dec = _Loaded(_read_spans(f, spans))
        gc.disable()  # tens of thousands of new objects; nothing cyclic to collect
        state = _decode_payload(meta, dec)
    except (MikuError, RecursionError) as exc:
        raise invalid(exc) from None
    finally:
        if gc_was_enabled:
            gc.enable()
    return state, algo, ok


def _too_large(path: object, size: int) -> str:
    return (
        f"{path} is {size} bytes, larger than the limit of {MAX_MIKU_BYTES} bytes "
        f"({MAX_MIKU_BYTES // 1024**2} MiB) for a session file"
    )


def _open(path: Path) -> tuple[BinaryIO, int]:
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the caller
    except FileNotFoundError:
        raise MikuError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise MikuError(f"{path} is a directory, not a .miku file") from None
    except OSError as exc:
        raise MikuError(f"{path} cannot be read: {exc.strerror or exc}") from None
    size = os.fstat(f.fileno()).st_size
    if size > MAX_MIKU_BYTES:
        f.close()
        raise MikuError(_too_large(path, size))
    return f, size


def _load_path(path: Path, *, verify: bool) -> tuple[MikuState, str, bool, int]:
    f, size = _open(path)
    try:
        with f:
            return (*_load(f, size, path, verify=verify), size)
    except OSError as exc:
        raise MikuError(f"{path} cannot be read: {exc.strerror or exc}") from None


def decode_miku(data: bytes, *, path: str | os.PathLike[str] = "<bytes>") -> MikuState:
    """Parse and validate the bytes of a ``.miku`` v2 file (v2.0 or v2.1)."""
    if len(data) > MAX_MIKU_BYTES:
        raise MikuError(_too_large(path, len(data)))
    return _load(io.BytesIO(data), len(data), Path(path))[0]


def read_miku(
    path: str | os.PathLike[str],
    *,
    expected_fingerprint: str | None = None,
    allow_other_model: bool = False,
) -> MikuState:
    """Load a ``.miku`` v2 file (v2.0 or v2.1), strictly.

    If ``expected_fingerprint`` is given and the file was saved with another
    model, raise :class:`MikuError` unless ``allow_other_model`` is set, in
    which case a :class:`UserWarning` is issued and the state returned.
    """
    path = Path(path)
    state = _load_path(path, verify=True)[0]
    got = state.header["model_fingerprint"]
    if expected_fingerprint is not None and got != expected_fingerprint:
        msg = (
            f"{path} was saved with model {state.header['model_id']!r} (fingerprint {got[:16]}), "
            f"but the current model's fingerprint is {expected_fingerprint[:16]}"
        )
        if not allow_other_model:
            raise MikuError(
                msg
                + "; its geometry does not apply. Load it with --allow-other-model to use it anyway."
            )
        warnings.warn(
            msg + "; loading anyway because another model was allowed.", UserWarning, stacklevel=2
        )
    return state


def file_version(path: str | os.PathLike[str]) -> tuple[int, int]:
    """(major, minor) format version of a ``.miku`` file, from its first 16 bytes."""
    path = Path(path)
    f, _ = _open(path)
    with f:
        head = f.read(_PREFIX.size)
    if len(head) < _PREFIX.size or head[:8] != MAGIC:
        raise MikuError(f"{path} is not a .miku v2 file")
    return _PREFIX.unpack(head)[1:3]


def inspect_miku(
    path: str | os.PathLike[str], *, check: Callable[[MikuState], None] | None = None
) -> dict[str, Any]:
    """A summary of a ``.miku`` file for ``isagi inspect``.

    Returns header, format version (major and minor), file size, checksum
    algorithm and status ("ok" or "mismatch"), tensor shapes/dtypes,
    trajectory count and columns, message count, ``metric_growth`` =
    ||M - I||_F when a square "metric" tensor is present, and ``refused``:
    why loading the file would fail, or None. A file whose checksum does not
    match is still summarised when its contents parse (``refused`` then says
    so); ``check`` is the loader's check of what the values mean (it raises
    :class:`MikuError`; :func:`isagi.session.files.check_session_state`), run on
    a file whose checksum matches, and what it raises is ``refused``. A file
    this module cannot read (malformed, over a limit) raises
    :class:`MikuError`, as reading it would.
    """
    path = Path(path)
    state, algo, ok, size = _load_path(path, verify=False)
    refused = None
    if not ok:
        refused = f"the {algo} checksum does not match its contents (the file is damaged)"
    elif check is not None:
        try:
            check(state)
        except MikuError as exc:
            refused = str(exc)
    growth = None
    metric = state.tensors.get("metric")
    if metric is not None and metric.ndim == 2 and metric.shape[0] == metric.shape[1]:
        m = metric.astype(np.float64)
        growth = float(np.linalg.norm(m - np.eye(m.shape[0]), "fro"))
    return {
        "path": str(path),
        "format_version": FORMAT_VERSION,
        "format_minor": file_version(path)[1],
        "size_bytes": size,
        "checksum": {"algo": algo, "status": "ok" if ok else "mismatch"},
        "header": dict(state.header),
        "tensors": {
            k: {"dtype": v.dtype.name, "shape": list(v.shape), "bytes": int(v.nbytes)}
            for k, v in state.tensors.items()
        },
        "trajectories": state.n_trajectories,
        "trajectory_columns": sorted(state.trajectories),
        "tiers": _counts(state.trajectories.get("tier")),
        "messages": len(state.conversation),
        "turns": sum(1 for m in state.conversation if m.get("role") == "user"),
        "verdicts": _counts(
            [m.get("verdict") for m in state.conversation if m.get("role") == "assistant"]
        ),
        "metric_growth": growth,
        "extra_keys": sorted(state.extra),
        "refused": refused,
    }


def _counts(values: Any) -> dict[str, int]:
    """How often each string value occurs (None and non-strings left out), most common first."""
    if values is None:
        return {}
    counts: dict[str, int] = {}
    for v in values:
        if isinstance(v, str) and v:
            counts[v] = counts.get(v, 0) + 1
    return dict(sorted(counts.items(), key=lambda kv: (-kv[1], kv[0])))


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
