"""Hostile ``.miku`` files, built byte by byte: the bombs the reader must refuse cheaply.

Each builder returns the complete bytes of a file whose checksum is correct
(so what is tested is the reader's bounds, not its checksum). Shared by the
bomb tests and the hostile-file corpus.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np

from storage import miku


def frame(payload: bytes, minor: int = 1, algo: str = "crc32") -> bytes:
    """A file around ``payload`` (the bytes after the checksum record), checksum correct."""
    hasher = miku._Hasher(algo)
    hasher.update(payload)
    record = msgpack.packb({"algo": algo, "digest": hasher.digest()})
    return miku._PREFIX.pack(miku.MAGIC, 2, minor, len(record)) + record + payload


def v21(meta: bytes | dict, area: bytes = b"") -> bytes:
    """A v2.1 file of raw (or packed) meta bytes and a data area."""
    if isinstance(meta, dict):
        meta = msgpack.packb(meta, use_bin_type=True)
    return frame(struct.pack("<I", len(meta)) + meta + area)


def split(data: bytes) -> tuple[dict, bytes]:
    """(meta, data area) of a v2.1 file."""
    rec_len = miku._PREFIX.unpack_from(data)[3]
    start = miku._PREFIX.size + rec_len
    meta_len = struct.unpack_from("<I", data, start)[0]
    return msgpack.unpackb(data[start + 4 : start + 4 + meta_len]), data[start + 4 + meta_len :]


def to_v20(data: bytes) -> bytes:
    """The same session as a v2.0 file: tensors inline, the string table a plain list."""
    meta, area = split(data)

    def inline(node):
        if isinstance(node, dict):
            if set(node) == {"dtype", "shape", "offset"}:
                n = int(np.prod(node["shape"])) * miku.DTYPES[node["dtype"]].itemsize
                return {"dtype": node["dtype"], "shape": node["shape"],
                        "data": area[node["offset"] : node["offset"] + n]}
            return {k: inline(v) for k, v in node.items()}
        if isinstance(node, list):
            return [inline(v) for v in node]
        return node

    texts: list[str] = []
    for g in meta["strings"]["groups"]:
        raw = area[g["data"]["offset"] : g["data"]["offset"] + g["data"]["shape"][0]].decode(g["encoding"])
        if g["sep"] is not None:
            texts += raw.split(g["sep"], g["count"])
        else:
            o = g["lengths"]["offset"]
            lengths = np.frombuffer(area[o : o + 8 * g["count"]], "<i8")
            ends = np.cumsum(lengths)
            texts += [raw[e - n : e] for e, n in zip(ends.tolist(), lengths.tolist(), strict=True)]
    payload = {k: inline(v) for k, v in meta.items() if k != "strings"}
    payload["strings"] = texts
    return frame(msgpack.packb(payload, use_bin_type=True), minor=0)


def _header() -> dict:
    return miku.new_header(model_id="m", model_fingerprint="f", d=4, k=2, layer=0)


def _t(dtype: str, shape: list[int], offset: int) -> dict:
    return {"dtype": dtype, "shape": shape, "offset": offset}


def messages(n: int, *, bool_fields: int = 0, distinct: bool = False) -> bytes:
    """A structurally valid v2.1 file of ``n`` messages (two texts, or ``n`` distinct ones)."""
    if distinct:
        texts = [f"{i:x}" for i in range(n)]
        idx = np.arange(n, dtype=np.int32)
    else:
        texts = ["user", "hi"]
        idx = np.zeros(n, np.int32)
    blob = "\n".join(texts).encode("latin-1")
    role = np.zeros(n, np.int32)
    area = bytearray()

    def put(arr: np.ndarray | bytes, dtype: str, shape: list[int]) -> dict:
        desc = _t(dtype, shape, len(area))
        area.extend(arr if isinstance(arr, bytes) else arr.tobytes())
        return desc

    group = {"encoding": "latin-1", "count": len(texts), "sep": "\n", "lengths": None,
             "data": put(blob, "uint8", [len(blob)])}
    meta = {
        "header": _header(),
        "strings": {"n": len(texts), "groups": [group]},
        "tensors": {},
        "trajectories": {"n": 0, "columns": {}},
        "conversation": {
            "n": n,
            "role": {"dtype": "str", "index": put(role, "int32", [n])},
            "text": {"dtype": "str", "index": put(idx, "int32", [n])},
            "fields": {
                f"f{j}": {"rows": None, "values": put(np.ones(n, np.bool_), "bool", [n])}
                for j in range(bool_fields)
            },
        },
        "extra": {},
    }
    return v21(meta, bytes(area))


def one_text(chars: int) -> bytes:
    """A valid v2.1 file whose one message is a text of ``chars`` characters."""
    blob = b"a" * chars
    area = blob + np.zeros(1, np.int32).tobytes() * 2
    meta = {
        "header": _header(),
        "strings": {"n": 1, "groups": [{"encoding": "latin-1", "count": 1, "sep": "\n",
                                        "lengths": None, "data": _t("uint8", [chars], 0)}]},
        "tensors": {},
        "trajectories": {"n": 0, "columns": {}},
        "conversation": {"n": 1, "role": {"dtype": "str", "index": _t("int32", [1], chars)},
                         "text": {"dtype": "str", "index": _t("int32", [1], chars + 4)},
                         "fields": {}},
        "extra": {},
    }
    return v21(meta, area)


def empty_maps(n: int, minor: int = 1) -> bytes:
    """A meta (v2.1) or payload (v2.0) that is one array of ``n`` empty maps."""
    body = b"\xdd" + struct.pack(">I", n) + b"\x80" * n
    if minor == 0:
        return frame(body, minor=0)
    return v21(body)


def nested_arrays(depth: int) -> bytes:
    return v21(b"\x91" * depth + b"\xc0")


def many_short_strings(n: int, minor: int = 1) -> bytes:
    """An array of ``n`` two-character strings (~21x their bytes as Python objects)."""
    body = b"\xdd" + struct.pack(">I", n) + b"\xa2ab" * n
    return frame(body, minor=0) if minor == 0 else v21(body)


def declared(kind: str) -> bytes:
    """A meta whose first object declares far more than the file holds."""
    head = {
        "array32": b"\xdd\xff\xff\xff\xff",
        "map32": b"\xdf\xff\xff\xff\xff",
        "str32": b"\xdb\xff\xff\xff\xff",
        "bin32": b"\xc6\xff\xff\xff\xff",
        "ext": b"\xc9\xff\xff\xff\xff\x01",
    }[kind]
    return v21(head + b"\x00" * 64)
