"""A :class:`MikuState` as the bytes of a ``.miku`` v2.1 file.

The state is validated with the reader's own checks, its arrays laid back to
back in the data area, its texts interned into the string table and grouped
by character width, its messages turned into columns; then the whole is
checked against the limits a reader puts on a file, in the reader's order,
so nothing a reader would refuse is ever encoded. Writing the bytes to disk
is :mod:`storage.miku.writer`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, NamedTuple

import msgpack
import numpy as np

from isagi.errors import MikuError
from isagi.storage.miku import limits
from isagi.storage.miku.budget import _check_declared, _check_items, _Texts
from isagi.storage.miku.frame import (
    _META_LEN,
    _PREFIX,
    _SEPARATORS,
    _TENSOR_KEYS,
    _TEXT_GROUPS,
    CHECKSUM_ALGOS,
    DEFAULT_CHECKSUM,
    DTYPES,
    FORMAT_MINOR,
    FORMAT_VERSION,
    MAGIC,
    _Hasher,
)
from isagi.storage.miku.limits import _fail, _too_large
from isagi.storage.miku.scanner import _scan
from isagi.storage.miku.state import MikuState
from isagi.storage.miku.validate import (
    _check_conversation,
    _check_descriptor,
    _check_extra,
    _check_header,
    _check_map,
    _check_name,
    _check_shape_against_header,
)

_TEXT_BATCH = 256 * 1024  # characters per text group (see _batches)


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


def _intern(table: dict[str, int], texts: Sequence[str]) -> np.ndarray:
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
        if size > limits.MAX_MIKU_BYTES:
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

