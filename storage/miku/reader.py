"""Reading a ``.miku`` file, strictly, in the order that bounds what it costs.

A file over the size limit is refused before it is read; the checksum is
verified over the whole payload, in small pieces, before anything of it is
parsed; the meta is scanned and its declared counts and memory checked
before it is built; the tensors must tile the data area before each is read
straight into its own array; only then is the state built
(:mod:`storage.miku.decode`). Every failure is one :class:`MikuError` that
names the file. Also the summary ``isagi inspect`` prints and the version of
a file from its first bytes. The order and its bounds: docs/miku-format.md.
"""

from __future__ import annotations

import gc
import io
import math
import os
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import Any, NamedTuple, Protocol

import numpy as np

from isagi.errors import MikuError
from isagi.storage.miku import limits
from isagi.storage.miku.budget import _check_declared, _check_items
from isagi.storage.miku.decode import _decode_payload, _Decoder, _Inline, _Loaded
from isagi.storage.miku.frame import (
    _META_LEN,
    _NATIVE_LE,
    _PREFIX,
    _TENSOR_KEYS,
    CHECKSUM_ALGOS,
    FORMAT_MINOR,
    FORMAT_VERSION,
    MAGIC,
    _Hasher,
)
from isagi.storage.miku.limits import _fail, _too_large
from isagi.storage.miku.scanner import _build, _scan, _unpack
from isagi.storage.miku.state import MikuState
from isagi.storage.miku.validate import _check_descriptor, _check_map, _is_int

_HASH_CHUNK = 512 * 1024  # read and hash in pieces that fit in L2


class _Source(Protocol):
    """What a file is read from: the file itself (:func:`_open`) or its bytes (:func:`decode_miku`)."""

    def read(self, size: int = -1, /) -> bytes: ...
    def readinto(self, buffer: memoryview, /) -> int | None: ...
    def seek(self, offset: int, whence: int = 0, /) -> int: ...


def _read_exact(f: _Source, n: int, what: str) -> bytes:
    data = f.read(n) if n else b""
    if len(data) != n:
        raise MikuError(f"is truncated ({what} ends after {len(data)} of {n} bytes)")
    return data


def _read_into(f: _Source, buf: memoryview) -> None:
    """Fill ``buf`` from ``f``."""
    got, size = 0, len(buf)
    while got < size:
        n = f.readinto(buf[got:])
        if not n:
            raise MikuError(f"is truncated (the data area ends {size - got} bytes early)")
        got += n


def _hash_rest(f: _Source, hasher: _Hasher) -> int:
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
    desc: dict[str, Any]
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
        if depth > limits.MAX_EXTRA_DEPTH:
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


def _read_spans(f: _Source, spans: list[_Span]) -> dict[int, np.ndarray]:
    """Read each tensor of the data area straight into its own (writable) array."""
    arrays: dict[int, np.ndarray] = {}
    for span in spans:
        arr = np.empty(span.shape, dtype=span.dtype)
        if span.nbytes:
            # numpy's stubs give ndarray the buffer protocol (__buffer__) from Python 3.12 only
            _read_into(f, memoryview(arr.reshape(-1).view(np.uint8)))  # type: ignore[arg-type]
        if not _NATIVE_LE and span.dtype.itemsize > 1:  # pragma: no cover - big-endian hosts
            arr = arr.astype(span.dtype.newbyteorder("="))
        arrays[id(span.desc)] = arr
    return arrays


def _version_text(major: int, minor: int) -> str:
    return f"{major}" if minor == 0 else f"{major}.{minor}"


def _load(
    f: _Source, size: int, path: Path, *, verify: bool = True
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
    if rec_len > limits.MAX_RECORD_LEN or _PREFIX.size + rec_len > size:
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


def _open(path: Path) -> tuple[io.FileIO, int]:
    try:
        f = open(path, "rb", buffering=0)  # noqa: SIM115 - closed by the caller
    except FileNotFoundError:
        raise MikuError(f"{path} does not exist") from None
    except IsADirectoryError:
        raise MikuError(f"{path} is a directory, not a .miku file") from None
    except OSError as exc:
        raise MikuError(f"{path} cannot be read: {exc.strerror or exc}") from None
    size = os.fstat(f.fileno()).st_size
    if size > limits.MAX_MIKU_BYTES:
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


def decode_miku(
    data: bytes,
    *,
    path: str | os.PathLike[str] = "<bytes>",
    expected_fingerprint: str | None = None,
    allow_other_model: bool = False,
) -> MikuState:
    """Parse and validate the bytes of a ``.miku`` v2 file (v2.0 or v2.1); the model check as
    :func:`read_miku`'s."""
    if len(data) > limits.MAX_MIKU_BYTES:
        raise MikuError(_too_large(path, len(data)))
    state = _load(io.BytesIO(data), len(data), Path(path))[0]
    _check_model(state, Path(path), expected_fingerprint, allow_other_model)
    return state


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
    _check_model(state, path, expected_fingerprint, allow_other_model)
    return state


def _check_model(state: MikuState, path: Path, expected_fingerprint: str | None, allow_other_model: bool) -> None:
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
            msg + "; loading anyway because another model was allowed.", UserWarning, stacklevel=3
        )


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
    path: str | os.PathLike[str], *, check: Callable[[MikuState], object] | None = None
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

