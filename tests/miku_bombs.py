"""Hostile ``.miku`` files, built byte by byte: the bombs the reader must refuse cheaply.

Each builder returns the complete bytes of a file whose checksum is correct
(so what is tested is the reader's bounds, not its checksum). Shared by the
bomb tests and the hostile-file corpus.
"""

from __future__ import annotations

import struct

import msgpack
import numpy as np

from isagi.storage import miku
from isagi.storage.miku.frame import _PREFIX, _Hasher


def frame(payload: bytes, minor: int = 1, algo: str = "crc32") -> bytes:
    """A file around ``payload`` (the bytes after the checksum record), checksum correct."""
    hasher = _Hasher(algo)
    hasher.update(payload)
    record = msgpack.packb({"algo": algo, "digest": hasher.digest()})
    return _PREFIX.pack(miku.MAGIC, 2, minor, len(record)) + record + payload


def v21(meta: bytes | dict, area: bytes = b"") -> bytes:
    """A v2.1 file of raw (or packed) meta bytes and a data area."""
    if isinstance(meta, dict):
        meta = msgpack.packb(meta, use_bin_type=True)
    return frame(struct.pack("<I", len(meta)) + meta + area)


def split(data: bytes) -> tuple[dict, bytes]:
    """(meta, data area) of a v2.1 file."""
    rec_len = _PREFIX.unpack_from(data)[3]
    start = _PREFIX.size + rec_len
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


def _header(d: int = 4, k: int = 2) -> dict:
    return miku.new_header(model_id="m", model_fingerprint="f", d=d, k=k, layer=0)


def _t(dtype: str, shape: list[int], offset: int) -> dict:
    return {"dtype": dtype, "shape": shape, "offset": offset}


class _Area:
    """A v2.1 data area being built: each ``put`` appends an array and returns its descriptor."""

    def __init__(self) -> None:
        self.data = bytearray()

    def put(self, arr: np.ndarray | bytes, dtype: str | None = None) -> dict:
        if isinstance(arr, bytes):
            arr = np.frombuffer(arr, np.uint8)
        desc = _t(dtype or arr.dtype.name, list(arr.shape), len(self.data))
        self.data.extend(arr.tobytes())
        return desc

    def texts(self, texts: list[str]) -> dict:
        """One Latin-1 string table group of ``texts`` (none may hold a newline)."""
        blob = "\n".join(texts).encode("latin-1")
        group = {"encoding": "latin-1", "count": len(texts), "sep": "\n", "lengths": None,
                 "data": self.put(blob)}
        return {"n": len(texts), "groups": [group]}

    def index(self, idx: np.ndarray) -> dict:
        return {"dtype": "str", "index": self.put(np.asarray(idx, np.int32))}

    def session_tensors(self, d: int, k: int) -> dict:
        """The tensors a session file must hold (identity metric, axis-aligned basis)."""
        basis = np.zeros((d, k), np.float32)
        basis[np.arange(k), np.arange(k)] = 1.0
        return {
            "metric": self.put(np.eye(k)),
            "basis": self.put(basis),
            "mu": self.put(np.zeros(d, np.float32)),
            "singular_values": self.put(np.ones(k, np.float32)),
        }


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
    """A valid v2.1 file whose one message is a user's text of ``chars`` characters."""
    area = _Area()
    strings = area.texts(["a" * chars, "user"])
    meta = {
        "header": _header(),
        "strings": strings,
        "tensors": {},
        "trajectories": {"n": 0, "columns": {}},
        "conversation": {"n": 1, "role": area.index(np.ones(1)), "text": area.index(np.zeros(1)),
                         "fields": {}},
        "extra": {},
    }
    return v21(meta, bytes(area.data))


def many_texts(n: int) -> bytes:
    """A string table of ``n`` distinct short texts (~6 bytes each), one message using one of them."""
    area = _Area()
    strings = area.texts([f"{i:x}" for i in range(n)])
    meta = {
        "header": _header(),
        "strings": strings,
        "tensors": {},
        "trajectories": {"n": 0, "columns": {}},
        "conversation": {"n": 1, "role": area.index(np.zeros(1)), "text": area.index(np.zeros(1)),
                         "fields": {}},
        "extra": {},
    }
    return v21(meta, bytes(area.data))


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


_SESSION_EXTRA = {"metric": {"version": 0, "updates": 0, "floor_events": 0}}


def _trajectories(area: _Area, turn: np.ndarray, k: int, query: np.ndarray, reply: np.ndarray,
                  tier: np.ndarray, blank: int) -> dict:
    """The trajectory columns of one stored exchange per ``turn`` (string table indices given)."""
    n = len(turn)
    asked = 1_700_000_000.0 + 10.0 * turn
    coords = np.random.default_rng(0).standard_normal((2, n, k)).astype(np.float32)
    return {"n": n, "columns": {
        "id": area.put(turn.astype(np.int64)),
        "query_x": area.put(coords[0]),
        "reply_x": area.put(coords[1]),
        "query_text": area.index(query),
        "reply_text": area.index(reply),
        "tier": area.index(tier),
        "context_key": area.index(np.full(n, blank)),
        "content_key": area.index(query),  # the questions are lower case: their own key
        "cluster": area.put((turn % 7).astype(np.int32)),
        "created": area.put(asked),
        "last_hit": area.put(asked),
        "hits": area.put(np.zeros(n, np.int32)),
    }}


def amplified(refs: int, chars: int = 2**20) -> bytes:
    """A session whose one text of ``chars`` characters is the text of ``refs`` messages.

    The text is stored once, so the file is about ``chars`` bytes, but its
    conversation holds ``refs * chars`` characters: whatever handles each
    message once (the page, the history store, an export) handles them all.
    Loadable by :func:`isagi.session.files.load_session` for an engine of hidden
    size 4 (before the reader counted texts at each use, it was).
    """
    area = _Area()
    strings = area.texts(["a" * chars, "user", "assistant", ""])
    role = np.arange(refs, dtype=np.int32) % 2 + 1
    none = np.zeros(0, np.int32)
    meta = {
        "header": _header(),
        "strings": strings,
        "tensors": area.session_tensors(4, 2),
        "trajectories": _trajectories(area, none, 2, none, none, none, 3),
        "conversation": {"n": refs, "role": area.index(role),
                         "text": area.index(np.zeros(refs, np.int32)), "fields": {}},
        "extra": _SESSION_EXTRA,
    }
    return v21(meta, bytes(area.data))


def long_session(turns: int, *, d: int = 4, k: int = 2) -> bytes:
    """A complete session of ``turns`` short exchanges: every turn a question, its
    reply (with its time, tier and verdict) and its trajectory, as the app stores them.

    Loadable by :func:`isagi.session.files.load_session` for an engine of hidden
    size ``d`` (about 210 bytes a turn) when the reader's limits allow it.
    """
    area = _Area()
    questions = [f"what is question number {i} about, briefly?" for i in range(turns)]
    replies = [f"the answer to question {i} is short and plain." for i in range(turns)]
    tiers = ["EXPAND", "AUGMENT", "EXPLORE"]
    strings = area.texts(["user", "assistant", "ok", "", *tiers, *questions, *replies])
    turn = np.arange(turns)
    query, reply, tier = 7 + turn, 7 + turns + turn, 4 + turn % 3
    n = 2 * turns
    role = np.zeros(n, np.int32)
    role[1::2] = 1
    text = np.empty(n, np.int32)
    text[0::2], text[1::2] = query, reply
    rows = np.arange(1, n, 2, dtype=np.int64)  # the replies
    times = 1_700_000_000.0 + np.arange(n) * 5.0
    meta = {
        "header": _header(d, k),
        "strings": strings,
        "tensors": area.session_tensors(d, k),
        "trajectories": _trajectories(area, turn, k, query, reply, tier, 3),
        "conversation": {"n": n, "role": area.index(role), "text": area.index(text), "fields": {
            "time": {"rows": None, "values": area.put(times)},
            "tier": {"rows": area.put(rows), "values": area.index(tier)},
            "verdict": {"rows": area.put(rows), "values": area.index(np.full(turns, 2))},
        }},
        "extra": {"title": "a long chat", **_SESSION_EXTRA},
    }
    return v21(meta, bytes(area.data))
