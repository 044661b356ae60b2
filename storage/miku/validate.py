"""The shape checks of a ``.miku`` file's parts, shared by the writer and the reader.

A header, a name, a map, the extra settings, a message, a tensor descriptor
and its shape against the header: each check raises :class:`MikuError` with
where and what, and the writer runs the same one on what it is about to write
as the reader on what it has read, so the two refuse the same things in the
same words. They check structure and types only; what the values *mean* is
checked by :mod:`isagi.session.files`.
"""

from __future__ import annotations

import datetime as _dt
import math
from typing import Any, TypeGuard

import numpy as np

from isagi.storage.miku import limits
from isagi.storage.miku.frame import DTYPES, FORMAT_VERSION
from isagi.storage.miku.limits import _fail

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
_SCALARS = (str, int, float, bool, type(None))
_SCALAR_TYPES = frozenset(_SCALARS)


def _is_int(v: object) -> TypeGuard[int]:
    return isinstance(v, int) and not isinstance(v, bool)


def _check_name(where: str, name: object) -> str:
    if not isinstance(name, str) or not name or len(name) > limits.MAX_NAME_LEN:
        raise _fail(
            where,
            f"invalid name {name!r} (a non-empty string of at most {limits.MAX_NAME_LEN} characters)",
        )
    return name


def _check_map(where: str, obj: object) -> dict[Any, Any]:
    if not isinstance(obj, dict):
        raise _fail(where, f"expected a map, found {type(obj).__name__}")
    if len(obj) > limits.MAX_MAP_LEN:
        raise _fail(where, f"a map of {len(obj)} entries, more than the limit of {limits.MAX_MAP_LEN}")
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
    if depth > limits.MAX_EXTRA_DEPTH:
        raise _fail(where, f"nested deeper than {limits.MAX_EXTRA_DEPTH} levels")
    if isinstance(obj, _SCALARS):
        return
    if isinstance(obj, list):
        if len(obj) > limits.MAX_LIST_LEN:
            raise _fail(where, f"list of {len(obj)} items, more than {limits.MAX_LIST_LEN}")
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


def _check_shape_against_header(name: str, arr: np.ndarray, header: dict[str, Any], n: int | None) -> None:
    d, k = header["d"], header["k"]
    expected = {"metric": (k, k), "basis": (d, k), "mu": (d,)}.get(name)
    if n is not None and name in ("query_x", "reply_x"):
        expected = (n, k)
    if expected is not None and arr.shape != expected:
        raise _fail(
            f"{name}",
            f"shape {list(arr.shape)} does not match header d={d}, k={k} (expected {list(expected)})",
        )


def _check_descriptor(where: str, obj: object, keys: frozenset[str]) -> tuple[np.dtype, list[int]]:
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
    if not isinstance(shape, list) or len(shape) > limits.MAX_NDIM:
        raise _fail(where, f"shape must be a list of at most {limits.MAX_NDIM} sizes")
    count = 1
    for s in shape:
        if not _is_int(s) or s < 0 or s > limits.MAX_TENSOR_ELEMENTS:
            raise _fail(where, f"shape {str(shape)[:80]} has an invalid size {str(s)[:40]}")
        count *= s
    if count > limits.MAX_TENSOR_ELEMENTS:
        raise _fail(where, f"shape {shape} has {count} elements, more than {limits.MAX_TENSOR_ELEMENTS}")
    return DTYPES[dtype_name], shape


def _check_bool(where: str, arr: np.ndarray) -> None:
    if arr.dtype == np.bool_ and arr.size and int(arr.view(np.uint8).max()) > 1:
        raise _fail(where, "bool tensor holds bytes other than 0 and 1")


