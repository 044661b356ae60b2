"""10,000 damaged .miku files: every one must end in MikuError, nothing else.

The current layout (v2.1: msgpack meta + raw data area) gets the 10,000 cases;
3,000 more go to a v2.1 file whose texts are cut by their lengths (no free
separator), and 3,000 to the v2.0 layout (one msgpack payload, still read for
files users saved before 2.1), built from a real v2.0 file. Three kinds of
damage, all seeded:

* byte level: random bit flips anywhere (prefix, checksum record, meta,
  data), truncations, garbage appended or inserted;
* structural, re-checksummed: the meta (v2.0: the payload) is decoded, one
  constrained node is replaced by a value of another type, an absurd shape, an
  unknown dtype, a tensor moved off its place in the data area (v2.0: data of
  the wrong length), an out-of-range index, a missing or unknown key..., then
  packed again with a *correct* checksum, so the validation behind the
  checksum is what must catch it;
* hostile msgpack, re-checksummed: declared lengths of 2**32-1 with no data,
  very deep nesting, ext types, non-string map keys.

Decoding goes through ``decode_miku`` (what ``read_miku`` runs on the file's
bytes); every 100th case also goes through a real file and ``read_miku``.
"""

from __future__ import annotations

import copy
import hashlib
import math
import resource
import struct
import zlib
from pathlib import Path
from typing import Any

import msgpack
import numpy as np
import pytest

from isagi.errors import MikuError
from isagi.storage import miku
from isagi.storage.miku import decode_miku, encode_miku, read_miku
from isagi.storage.miku.frame import _PREFIX, _SEPARATORS
from isagi.storage.miku.validate import _HEADER_REQUIRED
from tests.test_miku import make_state
from tests.test_miku_compat import V20_FILE, frame_v21, split_v21

N_CASES = 10_000
N_CASES_EXTRA = 3_000
JUNK: list[Any] = [
    None,
    True,
    False,
    0,
    -1,
    2**63 - 1,
    -(2**63),
    1.5,
    float("nan"),
    "",
    "x" * 300,
    b"",
    b"\x00\xff",
    [],
    [1, "a"],
    {},
    {"a": 1},
]


def _frame20(payload: bytes, algo: str = "blake2b") -> bytes:
    """A v2.0 file: its version field was one uint32 = 2."""
    record = msgpack.packb({"algo": algo, "digest": hashlib.new(algo, payload).digest()})
    return struct.pack("<8sII", miku.MAGIC, 2, len(record)) + record + payload


def _frame21(meta_bytes: bytes, area: bytes) -> bytes:
    """A v2.1 file around already-packed meta bytes, with a correct crc32."""
    payload = struct.pack("<I", len(meta_bytes)) + meta_bytes + area
    record = msgpack.packb({"algo": "crc32", "digest": zlib.crc32(payload).to_bytes(4, "big")})
    return _PREFIX.pack(miku.MAGIC, 2, 1, len(record)) + record + payload


def _constrained_paths(node: Any, path: tuple = ()) -> list[tuple]:
    """Paths of nodes whose type the format fixes (free-form values excluded)."""
    out = [path]
    if path[:1] == ("extra",) and len(path) >= 2:
        return []  # anything JSON-like is allowed inside extra
    if path[:1] == ("header",) and len(path) == 2 and path[1] not in _HEADER_REQUIRED:
        return []  # optional header scalars may be any scalar
    if (
        len(path) == 5
        and path[:2] == ("conversation", "fields")
        and path[3] == "values"
        and isinstance(path[4], int)
    ):
        return []  # per-message values in a plain list may be any scalar
    if isinstance(node, dict):
        for k, v in node.items():
            out += _constrained_paths(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            out += _constrained_paths(v, (*path, i))
    return out


def _get(node: Any, path: tuple) -> Any:
    for p in path:
        node = node[p]
    return node


def _set(root: Any, path: tuple, value: Any) -> None:
    _get(root, path[:-1])[path[-1]] = value


def _is_tensor(node: Any) -> bool:
    return isinstance(node, dict) and {"dtype", "shape"} <= set(node) and len(node) == 3


def _tensor_paths(node: Any, path: tuple = ()) -> list[tuple]:
    if _is_tensor(node):
        return [path]
    out: list[tuple] = []
    if path[:1] in (("header",), ("extra",)):
        return out
    items = (
        node.items()
        if isinstance(node, dict)
        else enumerate(node)
        if isinstance(node, list)
        else ()
    )
    for k, v in items:
        out += _tensor_paths(v, (*path, k))
    return out


def _nbytes(t: dict) -> int:
    if "data" in t:
        return len(t["data"])
    return math.prod(t["shape"]) * miku.DTYPES[t["dtype"]].itemsize


class _Area:
    """Read and patch a tensor's bytes, inline (v2.0) or in the data area (v2.1)."""

    def __init__(self, area: bytearray | None) -> None:
        self.area = area

    def get(self, t: dict, dtype: str) -> np.ndarray:
        if self.area is None:
            return np.frombuffer(t["data"], dtype).copy()
        return np.frombuffer(
            self.area, dtype, count=_nbytes(t) // np.dtype(dtype).itemsize, offset=t["offset"]
        ).copy()

    def put(self, t: dict, arr: np.ndarray) -> None:
        if self.area is None:
            t["data"] = arr.tobytes()
        else:
            self.area[t["offset"] : t["offset"] + arr.nbytes] = arr.tobytes()


def _structural(rng: np.random.Generator, base: dict, area: bytearray | None) -> dict:
    p = copy.deepcopy(base)
    data = _Area(area)
    kind = int(rng.integers(0, 9))
    if kind <= 2:  # a constrained node gets a value of another type
        paths = [q for q in _constrained_paths(p) if q]
        path = paths[int(rng.integers(len(paths)))]
        old = _get(p, path)
        choices = [j for j in JUNK if type(j) is not type(old)]
        _set(p, path, copy.deepcopy(choices[int(rng.integers(len(choices)))]))
    elif kind == 3:  # absurd or inconsistent shape
        tp = _tensor_paths(p)
        t = _get(p, tp[int(rng.integers(len(tp)))])
        size = _nbytes(t)
        t["shape"] = [
            [2**31, 2**31],
            [2**62],
            [-1],
            [1] * 9,
            [size + 1],
            [0],
            [3, -3],
            [True],
            [1.0],
            [2**64 - 1],
            ["1"],
        ][int(rng.integers(11))]
        if t["shape"] == [0] and size == 0:  # an empty tensor reshaped to [0] is still valid
            if area is None:
                t["data"] = b"\x00"
            else:
                t["offset"] = len(area) + 1
    elif kind == 4:  # dtype outside the whitelist, or the bytes are not where they should be
        tp = _tensor_paths(p)
        t = _get(p, tp[int(rng.integers(len(tp)))])
        if rng.random() < 0.5:
            t["dtype"] = ["object", "float128", "<U10", "O", "complex64", "uint32", "str", ""][
                int(rng.integers(8))
            ]
        elif area is None:
            t["data"] = (
                t["data"][: max(0, len(t["data"]) - int(rng.integers(1, 5)))]
                if t["data"]
                else b"\x01"
            )
        elif _nbytes(t) == 0:
            t["offset"] = len(area) + int(rng.integers(1, 5))
        else:
            step = int(rng.integers(1, 5))
            t["offset"] += step if rng.random() < 0.5 or t["offset"] < step else -step
    elif kind == 5:  # index or row numbers out of range / not increasing
        n_strings = len(p["strings"]) if area is None else p["strings"]["n"]
        col = p["trajectories"]["columns"]["query_text"]["index"]
        idx = data.get(col, "<i4")
        idx[int(rng.integers(len(idx)))] = [n_strings, -1, 2**31 - 1][int(rng.integers(3))]
        data.put(col, idx)
        if rng.random() < 0.5:
            rows_t = p["conversation"]["fields"]["created"]["rows"]
            r = data.get(rows_t, "<i8")
            r[-1] = r[0] if rng.random() < 0.5 else 10**9
            data.put(rows_t, r)
            data.put(col, idx.clip(0, 1))
    elif kind == 6:  # missing or unknown key somewhere constrained
        maps = [
            q
            for q in _constrained_paths(p)
            if isinstance(_get(p, q), dict)
            and _get(p, q)
            and q[:1] != ("extra",)
            and not (len(q) == 3 and q[:2] == ("trajectories", "columns"))
            and q
            not in {
                ("header",),
                ("tensors",),
                ("trajectories", "columns"),
                ("conversation", "fields"),
            }
        ]
        m = _get(p, maps[int(rng.integers(len(maps)))])
        if rng.random() < 0.5 or not m:
            m["unexpected_" + str(int(rng.integers(100)))] = 1
        else:
            del m[list(m)[int(rng.integers(len(m)))]]
    elif kind == 7:  # counts that disagree with the columns
        if rng.random() < 0.5:
            p["trajectories"]["n"] += int(rng.choice([-1, 1, 2**40]))
        else:
            p["conversation"]["n"] += int(rng.choice([-1, 1, 2**40]))
    else:  # header values out of range
        key, val = [
            ("d", 0),
            ("k", -5),
            ("k", 2**40),
            ("format_version", 1),
            ("layer", 10**9),
            ("created", "not a date"),
            ("d", 7),
        ][int(rng.integers(7))]
        p["header"][key] = val
    return p


def _hostile(rng: np.random.Generator, base: dict) -> bytes:
    """Raw msgpack with lies in it (the frame's checksum will be correct)."""
    keys = sorted(base)
    victim = keys[int(rng.integers(len(keys)))]
    lie = [
        b"\xdd\xff\xff\xff\xff",  # array32 of 4 billion items
        b"\xdf\xff\xff\xff\xff",  # map32 of 4 billion pairs
        b"\xdb\xff\xff\xff\xffabc",  # str32 of 4 GiB
        b"\xc6\xff\xff\xff\xff\x00",  # bin32 of 4 GiB
        b"\x91" * 200_000 + b"\xc0",  # deeply nested arrays
        b"\x81\x91\x01\x02",  # map with an array as key
        b"\xc7\x05\x01hello",  # ext type 1
        b"\xd6\xff\x00\x00\x00\x01",  # timestamp ext
        b"\xc1",  # never-used byte
        b"\xcf" + b"\xff" * 8,  # uint64 max
    ][int(rng.integers(10))]
    out = bytearray(struct.pack(">B", 0x80 | len(keys)))  # fixmap header
    for k in keys:
        out += msgpack.packb(k)
        out += lie if k == victim else msgpack.packb(base[k])
    if rng.random() < 0.3:
        out += b"\x00"  # trailing data after the map
    return bytes(out)


def _byte_level(rng: np.random.Generator, good: bytes) -> bytes:
    data = bytearray(good)
    kind = int(rng.integers(0, 4))
    if kind == 0:
        for _ in range(int(rng.integers(1, 9))):
            pos = int(rng.integers(len(data)))
            data[pos] ^= 1 << int(rng.integers(8))
    elif kind == 1:
        data = data[: int(rng.integers(0, len(data)))]
    elif kind == 2:
        pos = int(rng.integers(len(data)))
        data[pos:pos] = rng.bytes(int(rng.integers(1, 64)))
    else:
        data += rng.bytes(int(rng.integers(1, 64)))
    return bytes(data)


def _run_cases(tmp_path: Path, n_cases: int, seed: int, good: bytes, structural, hostile) -> None:
    rng = np.random.default_rng(seed)
    rss_before = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    kinds = {"byte": 0, "structural": 0, "hostile": 0}
    messages: set[str] = set()
    for i in range(n_cases):
        r = rng.random()
        if r < 0.45:
            data, kind = _byte_level(rng, good), "byte"
        elif r < 0.85:
            data, kind = structural(rng), "structural"
        else:
            data, kind = hostile(rng), "hostile"
        if data == good:
            continue  # a flip that flipped back; not damage
        kinds[kind] += 1
        try:
            if i % 100 == 0:
                f = tmp_path / f"case{i}.miku"
                f.write_bytes(data)
                read_miku(f)
            else:
                decode_miku(data)
        except MikuError as exc:
            assert str(exc), "MikuError without a message"
            messages.add(str(exc).split(":")[1][:40] if ":" in str(exc) else str(exc)[:40])
            continue
        except Exception as exc:  # pragma: no cover - this is the failure being looked for
            pytest.fail(f"case {i} ({kind}) raised {type(exc).__name__}: {exc}")
        pytest.fail(f"case {i} ({kind}) was accepted as a valid .miku file")
    assert sum(kinds.values()) >= n_cases - 5
    assert min(kinds.values()) > n_cases // 10  # every kind of damage was exercised
    assert len(messages) > 20  # the messages name many distinct problems
    # bounded allocation: declared 4 GiB lengths never got allocated
    rss_after = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    assert (rss_after - rss_before) * 1024 < 512 * 1024**2


@pytest.mark.timeout(300)
def test_ten_thousand_damaged_files_all_raise_mikuerror(tmp_path: Path) -> None:
    good = encode_miku(make_state(n=6, k=4, d=8))
    _, meta, area = split_v21(good)
    decode_miku(good)  # the base case itself is valid
    assert decode_miku(frame_v21(meta, area)) is not None  # and re-framing keeps it valid

    def structural(rng: np.random.Generator) -> bytes:
        patched = bytearray(area)
        mutated = _structural(rng, meta, patched)
        return _frame21(msgpack.packb(mutated, use_bin_type=True), bytes(patched))

    def hostile(rng: np.random.Generator) -> bytes:
        return _frame21(_hostile(rng, meta), area)

    _run_cases(tmp_path, N_CASES, 20240601, good, structural, hostile)


@pytest.mark.timeout(300)
def test_damaged_v20_files_all_raise_mikuerror(tmp_path: Path) -> None:
    good = V20_FILE
    record_len = struct.unpack_from("<I", good, 12)[0]
    base = msgpack.unpackb(good[16 + record_len :])  # the v2.0 payload as Python data
    decode_miku(good)
    assert decode_miku(_frame20(msgpack.packb(base))) is not None

    def structural(rng: np.random.Generator) -> bytes:
        return _frame20(msgpack.packb(_structural(rng, base, None)))

    def hostile(rng: np.random.Generator) -> bytes:
        return _frame20(_hostile(rng, base))

    _run_cases(tmp_path, N_CASES_EXTRA, 20240602, good, structural, hostile)


@pytest.mark.timeout(300)
def test_damaged_files_whose_texts_are_cut_by_length_all_raise_mikuerror(tmp_path: Path) -> None:
    every = "".join(_SEPARATORS)  # no free separator: texts are cut by their lengths
    state = make_state(n=6, k=4, d=8)
    state.trajectories["query_text"] = [every, "a" + every, "", "é" + every, "plain", "意" + every]
    good = encode_miku(state)
    _, meta, area = split_v21(good)
    assert any(g["lengths"] is not None for g in meta["strings"]["groups"])

    def structural(rng: np.random.Generator) -> bytes:
        patched = bytearray(area)
        mutated = _structural(rng, meta, patched)
        return _frame21(msgpack.packb(mutated, use_bin_type=True), bytes(patched))

    def hostile(rng: np.random.Generator) -> bytes:
        return _frame21(_hostile(rng, meta), area)

    _run_cases(tmp_path, N_CASES_EXTRA, 20240603, good, structural, hostile)
