"""A file's meta, checked, as a :class:`MikuState`: tensors, the string table, columns, messages.

The meta has already been scanned and its declared counts checked
(:mod:`storage.miku.scanner`, :mod:`storage.miku.budget`); here every section
is validated as it is turned into the state's arrays, text columns and
message dicts, the texts counted at each use before anything is built from
them. Tensors come from a decoder: :class:`_Inline` for v2.0 (bytes inside
the msgpack), :class:`_Loaded` for v2.1 (arrays already read from the data
area by :mod:`storage.miku.reader`).
"""

from __future__ import annotations

import math
from typing import Any

import numpy as np

from isagi.storage.miku import limits
from isagi.storage.miku.budget import _Texts
from isagi.storage.miku.frame import _ENCODINGS, _TENSOR_KEYS
from isagi.storage.miku.limits import _fail
from isagi.storage.miku.state import MikuState
from isagi.storage.miku.validate import (
    _SCALAR_TYPES,
    _check_bool,
    _check_descriptor,
    _check_extra,
    _check_header,
    _check_map,
    _check_name,
    _check_shape_against_header,
    _is_int,
)

_PAYLOAD_KEYS = frozenset({"header", "strings", "tensors", "trajectories", "conversation", "extra"})
_GROUP_KEYS = frozenset({"encoding", "count", "sep", "lengths", "data"})


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
        if len(obj) > limits.MAX_STRINGS:
            raise _fail("strings", f"{len(obj)} texts, more than the limit {limits.MAX_STRINGS}")
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
        if not _is_int(n) or not 0 <= n <= limits.MAX_STRINGS:
            raise _fail("strings", f"string count {str(n)[:40]} is invalid (at most {limits.MAX_STRINGS})")
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
            # numpy's stubs give ndarray the buffer protocol (__buffer__) from Python 3.12 only
            text: str = str(data, encoding)  # type: ignore[call-overload]
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
    if not _is_int(n) or not 0 <= n <= limits.MAX_TRAJECTORIES:  # the count is checked by _check_declared
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
    texts: list[str] = _text_array(where, obj, strings, n, dec).tolist()  # an object array of str
    return texts


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
    column: np.ndarray = strings.objects[idx]
    return column


def _decode_conversation(obj: object, strings: _Texts, dec: _Decoder) -> list[dict[str, Any]]:
    obj = _check_map("conversation", obj)
    if set(obj) != {"n", "role", "text", "fields"}:
        raise _fail("conversation", "fields must be n, role, text and fields")
    n = obj["n"]
    if not _is_int(n) or not 0 <= n <= limits.MAX_MESSAGES:  # the count is checked by _check_declared
        raise _fail("conversation", f"message count {str(n)[:40]} is invalid")
    roles = _text_array("conversation.role", obj["role"], strings, n, dec)
    texts = _text_array("conversation.text", obj["text"], strings, n, dec)
    columns: list[tuple[str, np.ndarray | None, list[Any]]] = []  # (field, its rows (None: all), values)
    fields = _check_map("conversation.fields", obj["fields"])
    if len(fields) > limits.MAX_MESSAGE_FIELDS:  # checked by _check_declared
        raise _fail("conversation", f"{len(fields)} message fields, more than {limits.MAX_MESSAGE_FIELDS}")
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
            if full is not None and key == full[0]:  # (rows is None: full is not None)
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
    values: list[Any] = arr.tolist()
    return values

