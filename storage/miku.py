"""The ``.miku`` v2 session file: one self-describing, checksummed, msgpack file.

This module owns the on-disk format of a saved session and nothing else: it
knows about headers, typed tensors, column-wise trajectories, a conversation
log and a small settings dict, but not what a metric or a basis *means*. The
research code pickled a PyTorch blob next to a JSON file (anyone who handed a
user a file could run code on their machine) and wrote it in place; this
format cannot execute code, is written atomically and is read strictly.

Layout (all integers little-endian)::

    offset 0   8 bytes   MAGIC = b"\\x89MIKU\\r\\n\\x1a"
    offset 8   uint32    format version (2)
    offset 12  uint32    length L of the checksum record
    offset 16  L bytes   msgpack map {"algo": "blake2b" | "sha256", "digest": bin}
    offset 16+L ...EOF   payload: one msgpack map, the checksum covers exactly it

Payload map (every key required, no others)::

    "header":       {format_version: int, created: ISO-8601 str, isagi_version: str,
                     model_id: str, model_fingerprint: str, d: int, k: int,
                     layer: int, + optional extra scalar fields}
    "tensors":      {name: TENSOR}
    "strings":      [str, ...]  the string table: every distinct text once
    "trajectories": {"n": int N, "columns": {name: TENSOR with shape[0] == N
                                             | {"dtype": "str", "index": TENSOR}}}
    "conversation": {"n": int M, "role": {"dtype": "str", "index": TENSOR},
                     "text": {"dtype": "str", "index": TENSOR},
                     "fields": {name: {"rows": nil | TENSOR int,
                                       "values": TENSOR | {"dtype": "str", "index": ...}
                                                 | [scalar]}}}
    "extra":        JSON-like dict (scalars, lists, nested dicts; bounded depth)

Texts (trajectory text columns, message roles and texts) live once in the
string table and are referenced by int32/int64 index tensors: a user message
and the query of its trajectory are the same string, so it is stored and
decoded once. Other per-message fields (time, tier, ...) are stored as
columns: the rows that have the field (nil when every message has it) and its
values in row order, as a float64/int64/bool tensor or string-table index when
they all share that type, else as a list of scalars. A message that lacks a
field reads back without it, ``None`` reads back ``None``, and every value
keeps its Python type.

    TENSOR = {"dtype": one of DTYPES, "shape": [int, ...], "data": bin}
             (C order, little-endian; bool stored one byte per element, 0 or 1)

Reading validates every field, bounds every size (file size, string and list
lengths, tensor elements, nesting depth) before allocating, never unpickles,
and raises exactly one exception type, :class:`isagi.errors.MikuError`, whose
message says what is wrong. Writing validates the same way first, so a file
this module writes is always one it can read back.
"""

from __future__ import annotations

import contextlib
import datetime as _dt
import errno
import gc
import hashlib
import math
import os
import struct
import tempfile
import threading
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import msgpack
import numpy as np

from isagi.errors import MikuError, StorageError

MAGIC = b"\x89MIKU\r\n\x1a"
FORMAT_VERSION = 2
_PREFIX = struct.Struct("<8sII")  # magic, format version, checksum record length

# Named checksum algorithms a reader accepts (name -> digest size in bytes).
CHECKSUM_ALGOS: dict[str, int] = {"blake2b": 64, "sha256": 32}
DEFAULT_CHECKSUM = "blake2b"

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

# Bounds. A reader refuses anything larger before allocating for it.
MAX_FILE_BYTES = 4 * 1024**3  # 4 GiB
MAX_STR_BYTES = 4 * 1024**2  # one text (a message, a query) at most 4 MiB
MAX_LIST_LEN = 20_000_000  # trajectories, messages, shape entries
MAX_MAP_LEN = 10_000  # keys in one map (tensor names, header fields, settings)
MAX_TENSOR_ELEMENTS = 2**31
MAX_NDIM = 8
MAX_NAME_LEN = 256
MAX_EXTRA_DEPTH = 8
_WRITE_CHUNK = 8 * 1024**2
_THREADED_HASH_BYTES = 1024**2

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
        raise _fail(where, f"{len(obj)} entries, more than the limit {MAX_MAP_LEN}")
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
            raise _fail(where, "list too long")
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
    if len(conv) > MAX_LIST_LEN:
        raise _fail("conversation", "too many messages")
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


def _encode_tensor(where: str, arr: object) -> dict[str, Any]:
    if not isinstance(arr, np.ndarray):
        raise _fail(where, f"expected a numpy array, found {type(arr).__name__}")
    name = arr.dtype.name
    if name not in DTYPES or arr.dtype.kind not in "fiub":
        raise _fail(where, f"dtype {arr.dtype} is not supported (allowed: {', '.join(DTYPES)})")
    if arr.ndim > MAX_NDIM:
        raise _fail(where, f"{arr.ndim} dimensions, more than {MAX_NDIM}")
    data = np.ascontiguousarray(arr, dtype=DTYPES[name])
    return {"dtype": name, "shape": list(arr.shape), "data": data.tobytes()}


def _encode_payload(state: MikuState) -> dict[str, Any]:
    if not isinstance(state, MikuState):
        raise _fail("state", f"expected a MikuState, found {type(state).__name__}")
    header = _check_header(dict(state.header))
    tensors = {}
    for name, arr in _check_map("tensors", state.tensors).items():
        _check_name("tensors", name)
        if isinstance(arr, np.ndarray):
            _check_shape_against_header(name, arr, header, None)
        tensors[name] = _encode_tensor(f"tensors[{name!r}]", arr)
    n = state.n_trajectories
    table: dict[str, int] = {}
    columns: dict[str, Any] = {}
    for name, col in _check_map("trajectories", state.trajectories).items():
        _check_name("trajectories", name)
        where = f"trajectories[{name!r}]"
        if isinstance(col, np.ndarray):
            if col.ndim == 0 or col.shape[0] != n:
                raise _fail(
                    where, f"has {col.shape[0] if col.ndim else 0} rows, other columns have {n}"
                )
            _check_shape_against_header(name, col, header, n)
            columns[name] = _encode_tensor(where, col)
        elif isinstance(col, list | tuple):
            if len(col) != n:
                raise _fail(where, f"has {len(col)} rows, other columns have {n}")
            for i, s in enumerate(col):
                if not isinstance(s, str):
                    raise _fail(where, f"row {i} must be a string, found {type(s).__name__}")
            columns[name] = {"dtype": "str", "index": _intern(table, col)}
        else:
            raise _fail(
                where, f"expected a numpy array or a list of strings, found {type(col).__name__}"
            )
    conversation = _check_conversation(list(state.conversation))
    extra = _check_map("extra", state.extra)
    _check_extra(extra, "extra")
    conv = _encode_conversation(conversation, table)
    return {
        "header": header,
        "strings": list(table),
        "tensors": tensors,
        "trajectories": {"n": n, "columns": columns},
        "conversation": conv,
        "extra": extra,
    }


def _intern(table: dict[str, int], texts: list[str]) -> dict[str, Any]:
    setdefault = table.setdefault
    idx = [setdefault(t, len(table)) for t in texts]
    dtype = np.int32 if len(table) < 2**31 else np.int64
    return _encode_tensor("string index", np.asarray(idx, dtype=dtype).reshape(len(texts)))


def _encode_conversation(conv: list[dict[str, Any]], table: dict[str, int]) -> dict[str, Any]:
    fields: dict[str, tuple[list[int], list[Any]]] = {}
    for i, msg in enumerate(conv):
        for key, val in msg.items():
            if key != "role" and key != "text":
                rows, values = fields.setdefault(key, ([], []))
                rows.append(i)
                values.append(val)
    n = len(conv)
    return {
        "n": n,
        "role": {"dtype": "str", "index": _intern(table, [m["role"] for m in conv])},
        "text": {"dtype": "str", "index": _intern(table, [m["text"] for m in conv])},
        "fields": {
            key: {
                # None: every message has the field (the common case)
                "rows": None if len(rows) == n else _encode_tensor(key, np.asarray(rows, np.int64)),
                "values": _encode_values(key, values, table),
            }
            for key, (rows, values) in fields.items()
        },
    }


def _encode_values(key: str, values: list[Any], table: dict[str, int]) -> Any:
    """Scalars of one message field: a typed column when they share one type."""
    kinds = set(map(type, values))
    if kinds == {float}:
        return _encode_tensor(key, np.asarray(values, dtype=np.float64))
    if kinds == {bool}:
        return _encode_tensor(key, np.asarray(values, dtype=np.bool_))
    if kinds == {str}:
        return {"dtype": "str", "index": _intern(table, values)}
    if kinds == {int} and min(values) >= -(2**63) and max(values) < 2**63:
        return _encode_tensor(key, np.asarray(values, dtype=np.int64))
    return values  # mixed types (None among numbers, ...): a plain list


def encode_miku(state: MikuState, *, checksum: str = DEFAULT_CHECKSUM) -> bytes:
    """The complete bytes of a ``.miku`` v2 file for ``state`` (validated first)."""
    if checksum not in CHECKSUM_ALGOS:
        raise MikuError(
            f"checksum algorithm {checksum!r} is not supported (use one of {sorted(CHECKSUM_ALGOS)})"
        )
    try:
        payload = msgpack.packb(_encode_payload(state), use_bin_type=True)
    except (TypeError, ValueError, OverflowError) as exc:
        raise MikuError(f"session cannot be encoded: {exc}") from None
    digest = hashlib.new(checksum, payload).digest()
    record = msgpack.packb({"algo": checksum, "digest": digest}, use_bin_type=True)
    return _PREFIX.pack(MAGIC, FORMAT_VERSION, len(record)) + record + payload


def _write_all(fd: int, data: bytes) -> None:
    view = memoryview(data)
    while view:
        written = os.write(fd, view[:_WRITE_CHUNK])
        if written <= 0:  # pragma: no cover - os.write raises instead
            raise OSError(errno.EIO, "write returned no progress")
        view = view[written:]


def write_miku(path: str | os.PathLike[str], state: MikuState) -> None:
    """Save ``state`` to ``path`` atomically.

    The bytes go to a temporary file in the same directory, which is fsynced
    and then renamed over ``path`` (and the directory fsynced), so a crash or
    a full disk at any moment leaves either the old file or the new one,
    never a mix. On an OS error the temporary file is removed, the old file is
    untouched, and :class:`StorageError` says what happened.
    """
    path = Path(path)
    blob = encode_miku(state)
    parent = path.parent if str(path.parent) else Path(".")
    tmp: str | None = None
    try:
        parent.mkdir(parents=True, exist_ok=True)
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=parent)
        try:
            with contextlib.suppress(OSError):
                os.fchmod(fd, path.stat().st_mode & 0o777 if path.exists() else 0o600)
            _write_all(fd, blob)
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


def _unpack(buf: bytes | memoryview, where: str) -> Any:
    try:
        return msgpack.unpackb(
            buf,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=MAX_STR_BYTES,
            max_bin_len=MAX_FILE_BYTES,
            max_array_len=MAX_LIST_LEN,
            max_map_len=MAX_MAP_LEN,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises ValueError, TypeError, UnicodeDecodeError, ...
        raise _fail(where, f"not valid msgpack ({type(exc).__name__}: {str(exc)[:200]})") from None


def _decode_tensor(where: str, obj: object) -> np.ndarray:
    obj = _check_map(where, obj)
    if set(obj) != {"dtype", "shape", "data"}:
        raise _fail(
            where, f"tensor fields must be dtype, shape, data; found {sorted(map(str, obj))}"
        )
    dtype_name, shape, data = obj["dtype"], obj["shape"], obj["data"]
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
    dtype = DTYPES[dtype_name]
    if not isinstance(data, bytes):
        raise _fail(where, f"data must be bytes, found {type(data).__name__}")
    if len(data) != count * dtype.itemsize:
        raise _fail(
            where,
            f"data is {len(data)} bytes, shape {shape} of {dtype_name} needs {count * dtype.itemsize}",
        )
    if dtype_name == "bool":
        raw = np.frombuffer(data, dtype=np.uint8)
        if raw.size and raw.max() > 1:
            raise _fail(where, "bool tensor holds bytes other than 0 and 1")
    arr = np.frombuffer(data, dtype=dtype).reshape(shape)
    return arr.astype(dtype.newbyteorder("="), copy=True)


def _decode_payload(payload: object) -> MikuState:
    payload = _check_map("payload", payload)
    keys = set(payload)
    if keys != _PAYLOAD_KEYS:
        missing, unknown = _PAYLOAD_KEYS - keys, keys - _PAYLOAD_KEYS
        raise _fail(
            "payload",
            f"missing sections {sorted(missing)}, unknown sections {sorted(map(str, unknown))}",
        )
    header = _check_header(payload["header"])
    strings = payload["strings"]
    if not isinstance(strings, list):
        raise _fail("strings", f"expected a list of strings, found {type(strings).__name__}")
    if not all(type(t) is str for t in strings):
        bad = next(i for i, t in enumerate(strings) if type(t) is not str)
        raise _fail("strings", f"entry {bad} is a {type(strings[bad]).__name__}, not a string")
    tensors = {}
    for name, obj in _check_map("tensors", payload["tensors"]).items():
        _check_name("tensors", name)
        arr = _decode_tensor(f"tensors[{name!r}]", obj)
        _check_shape_against_header(name, arr, header, None)
        tensors[name] = arr
    traj = _check_map("trajectories", payload["trajectories"])
    if set(traj) != {"n", "columns"}:
        raise _fail("trajectories", "fields must be n and columns")
    n = traj["n"]
    if not _is_int(n) or not 0 <= n <= MAX_LIST_LEN:
        raise _fail("trajectories", f"row count {str(n)[:40]} is invalid")
    trajectories: dict[str, np.ndarray | list[str]] = {}
    for name, obj in _check_map("trajectories.columns", traj["columns"]).items():
        _check_name("trajectories", name)
        where = f"trajectories[{name!r}]"
        if isinstance(obj, dict) and obj.get("dtype") == "str":
            trajectories[name] = _decode_texts(where, obj, strings, n)
        else:
            arr = _decode_tensor(where, obj)
            if arr.ndim == 0 or arr.shape[0] != n:
                raise _fail(where, f"has {arr.shape[0] if arr.ndim else 0} rows, expected {n}")
            _check_shape_against_header(name, arr, header, n)
            trajectories[name] = arr
    if not trajectories and n != 0:
        raise _fail("trajectories", f"declares {n} rows but has no columns")
    conversation = _decode_conversation(payload["conversation"], strings)
    extra = _check_map("extra", payload["extra"])
    _check_extra(extra, "extra")
    return MikuState(
        header=header,
        tensors=tensors,
        trajectories=trajectories,
        conversation=conversation,
        extra=extra,
    )


def _decode_texts(where: str, obj: object, strings: list[str], n: int) -> list[str]:
    obj = _check_map(where, obj)
    if set(obj) != {"dtype", "index"} or obj["dtype"] != "str":
        raise _fail(where, "a text column must have exactly dtype='str' and an index tensor")
    idx = _decode_tensor(f"{where}.index", obj["index"])
    if idx.dtype.kind not in "iu" or idx.shape != (n,):
        raise _fail(
            where,
            f"index must be an integer vector of {n} rows, found {idx.dtype} {list(idx.shape)}",
        )
    if n and (int(idx.min()) < 0 or int(idx.max()) >= len(strings)):
        raise _fail(where, f"index points outside the string table of {len(strings)} entries")
    return list(map(strings.__getitem__, idx.tolist()))


def _decode_conversation(obj: object, strings: list[str]) -> list[dict[str, Any]]:
    obj = _check_map("conversation", obj)
    if set(obj) != {"n", "role", "text", "fields"}:
        raise _fail("conversation", "fields must be n, role, text and fields")
    n = obj["n"]
    if not _is_int(n) or not 0 <= n <= MAX_LIST_LEN:
        raise _fail("conversation", f"message count {str(n)[:40]} is invalid")
    roles = _decode_texts("conversation.role", obj["role"], strings, n)
    texts = _decode_texts("conversation.text", obj["text"], strings, n)
    conv = [{"role": r, "text": t} for r, t in zip(roles, texts, strict=True)]
    for key, col in _check_map("conversation.fields", obj["fields"]).items():
        _check_name("conversation.fields", key)
        where = f"conversation.fields[{key!r}]"
        if key in ("role", "text"):
            raise _fail(where, "duplicates a required field")
        col = _check_map(where, col)
        if set(col) != {"rows", "values"}:
            raise _fail(where, "must have exactly rows and values")
        rows = None
        if col["rows"] is not None:
            rows = _decode_tensor(f"{where}.rows", col["rows"])
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
        values = _decode_values(where, col["values"], strings, count)
        if rows is None:
            for msg, v in zip(conv, values, strict=True):
                msg[key] = v
        else:
            for r, v in zip(rows.tolist(), values, strict=True):
                conv[r][key] = v
    return conv


def _decode_values(where: str, obj: object, strings: list[str], count: int) -> list[Any]:
    if isinstance(obj, list):
        if len(obj) != count:
            raise _fail(where, f"has {len(obj)} values for {count} rows")
        if not all(type(v) in _SCALAR_TYPES for v in obj):
            bad = next(v for v in obj if type(v) not in _SCALAR_TYPES)
            raise _fail(where, f"values must be scalars, found {type(bad).__name__}")
        return obj
    if isinstance(obj, dict) and obj.get("dtype") == "str":
        return _decode_texts(where, obj, strings, count)
    arr = _decode_tensor(where, obj)
    if arr.dtype.name not in ("float64", "int64", "bool") or arr.shape != (count,):
        raise _fail(
            where,
            f"values must be a float64/int64/bool vector of {count}, found {arr.dtype} {list(arr.shape)}",
        )
    return arr.tolist()


def _read_bytes(path: Path) -> bytes:
    try:
        with open(path, "rb") as f:
            size = os.fstat(f.fileno()).st_size
            if size > MAX_FILE_BYTES:
                raise MikuError(
                    f"{path} is {size} bytes, larger than the limit of {MAX_FILE_BYTES}: not a session file"
                )
            data = f.read(MAX_FILE_BYTES + 1)
    except FileNotFoundError:
        raise MikuError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise MikuError(f"{path} is a directory, not a .miku file") from None
    except OSError as exc:
        raise MikuError(f"{path} cannot be read: {exc.strerror or exc}") from None
    if len(data) > MAX_FILE_BYTES:
        raise MikuError(f"{path} is larger than the limit of {MAX_FILE_BYTES} bytes")
    return data


def _split(data: bytes, path: Path) -> tuple[str, bytes, memoryview]:
    """Check magic and version; return (algo, digest, payload view)."""
    if len(data) < _PREFIX.size:
        raise MikuError(f"{path} is not a .miku file (only {len(data)} bytes; truncated or empty)")
    magic, version, rec_len = _PREFIX.unpack_from(data)
    if magic != MAGIC:
        if data[:64].lstrip()[:1] in (b"{", b"["):
            raise MikuError(
                f"{path} looks like a legacy v1 (JSON) .miku file; convert it with `isagi import-legacy`"
            )
        raise MikuError(f"{path} is not a .miku file (wrong magic bytes)")
    if version != FORMAT_VERSION:
        raise MikuError(
            f"{path} has format version {version}; this ISAGI reads version {FORMAT_VERSION}"
        )
    if rec_len > 1024 or _PREFIX.size + rec_len > len(data):
        raise MikuError(f"{path} is truncated or corrupted (checksum record length {rec_len})")
    view = memoryview(data)
    record = _unpack(view[_PREFIX.size : _PREFIX.size + rec_len], f"{path}: checksum record")
    if not isinstance(record, dict) or set(record) != {"algo", "digest"}:
        raise MikuError(f"{path}: checksum record must have exactly algo and digest")
    algo, digest = record["algo"], record["digest"]
    if not isinstance(algo, str) or algo not in CHECKSUM_ALGOS:
        raise MikuError(f"{path}: checksum algorithm {str(algo)[:40]!r} is not supported")
    if not isinstance(digest, bytes) or len(digest) != CHECKSUM_ALGOS[algo]:
        raise MikuError(f"{path}: checksum digest has the wrong type or length for {algo}")
    return algo, digest, view[_PREFIX.size + rec_len :]


def decode_miku(data: bytes, *, path: str | os.PathLike[str] = "<bytes>") -> MikuState:
    """Parse and validate the bytes of a ``.miku`` v2 file."""
    path = Path(path)
    algo, digest, payload = _split(data, path)
    # Large payloads are hashed on a second thread (hashlib releases the GIL)
    # while the main thread decodes; decoding is strict on its own, so doing
    # it before the checksum verdict is safe. A mismatch always wins.
    computed: list[bytes] = []
    hasher = threading.Thread(target=lambda: computed.append(hashlib.new(algo, payload).digest()))
    threaded = len(payload) >= _THREADED_HASH_BYTES
    if threaded:
        hasher.start()
    else:
        hasher.run()
    error: MikuError | None = None
    state = None
    gc_was_enabled = gc.isenabled()
    gc.disable()  # tens of thousands of new objects; nothing cyclic to collect
    try:
        state = _decode_payload(_unpack(payload, "payload"))
    except MikuError as exc:
        error = MikuError(f"{path} is invalid: {exc}")
    except RecursionError:
        error = MikuError(f"{path} is invalid: nested too deeply")
    finally:
        if gc_was_enabled:
            gc.enable()
        if threaded:
            hasher.join()
    if computed != [digest]:
        raise MikuError(f"{path} is corrupted: the {algo} checksum does not match its contents")
    if error is not None:
        raise error
    return state


def read_miku(
    path: str | os.PathLike[str],
    *,
    expected_fingerprint: str | None = None,
    allow_other_model: bool = False,
) -> MikuState:
    """Load a ``.miku`` v2 file, strictly.

    If ``expected_fingerprint`` is given and the file was saved with another
    model, raise :class:`MikuError` unless ``allow_other_model`` is set, in
    which case a :class:`UserWarning` is issued and the state returned.
    """
    path = Path(path)
    state = decode_miku(_read_bytes(path), path=path)
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


def inspect_miku(path: str | os.PathLike[str]) -> dict[str, Any]:
    """A summary of a ``.miku`` file for ``isagi inspect``.

    Returns header, file size, checksum algorithm and status ("ok" or
    "mismatch"), tensor shapes/dtypes, trajectory count and columns, message
    count, and ``metric_growth`` = ||M - I||_F when a square "metric" tensor is
    present. A file whose checksum does not match is still summarised when its
    payload parses; anything unreadable raises :class:`MikuError`.
    """
    path = Path(path)
    data = _read_bytes(path)
    algo, digest, payload = _split(data, path)
    ok = hashlib.new(algo, payload).digest() == digest
    try:
        state = _decode_payload(_unpack(payload, "payload"))
    except MikuError as exc:
        status = "ok" if ok else "mismatch"
        raise MikuError(f"{path} is invalid (checksum {status}): {exc}") from None
    except RecursionError:
        raise MikuError(f"{path} is invalid: nested too deeply") from None
    growth = None
    metric = state.tensors.get("metric")
    if metric is not None and metric.ndim == 2 and metric.shape[0] == metric.shape[1]:
        m = metric.astype(np.float64)
        growth = float(np.linalg.norm(m - np.eye(m.shape[0]), "fro"))
    return {
        "path": str(path),
        "format_version": FORMAT_VERSION,
        "size_bytes": len(data),
        "checksum": {"algo": algo, "status": "ok" if ok else "mismatch"},
        "header": dict(state.header),
        "tensors": {
            k: {"dtype": v.dtype.name, "shape": list(v.shape), "bytes": int(v.nbytes)}
            for k, v in state.tensors.items()
        },
        "trajectories": state.n_trajectories,
        "trajectory_columns": sorted(state.trajectories),
        "messages": len(state.conversation),
        "metric_growth": growth,
        "extra_keys": sorted(state.extra),
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
