"""The .miku v2.1 layout, and v2.0 files (written by ISAGI before 2.1) still being read.

``V20_FILE`` is a real file written by the v2.0 writer (``encode_miku(make_state())``
at commit 7d674db, with a fixed ``created``), zlib-compressed and base64-encoded,
so these tests read what users' saved files contain, not what today's code
would write.
"""

from __future__ import annotations

import base64
import struct
import zlib
from pathlib import Path

import msgpack
import numpy as np
import pytest

from isagi.errors import MikuError
from isagi.storage import miku
from isagi.storage.miku import (
    decode_miku,
    encode_miku,
    file_version,
    inspect_miku,
    read_miku,
    write_miku,
)
from isagi.storage.miku.decode import _Loaded
from isagi.storage.miku.frame import _PREFIX, _SEPARATORS, _Hasher
from tests.test_miku import assert_same, make_state

V20_CREATED = "2026-11-22T08:00:00+00:00"
V20_FILE = zlib.decompress(
    base64.b64decode(
        "eNrtm3lYE2cex4eAUVDqfbbVEd2KVeSQUqqSIWCUtBBZBLFqi5PMmzCSTOLMcHkRFA/WXS3W+yR3ONR6davVDBatrVqtuhbx"
        "7KJYsevWautt7SR54yoPrXV3/W8+Dz/ezDzv+3u/7+/9ve/keZ9MaYr8nYzgoF4iBEEyeZttxbUavUOpxXNAlNJOkBrAsPvi"
        "18Vey2wcil20nCF+LH7/86hlw+VHzR9Fv7FWdyszazNzaYhzlmP29ui20mHBhx4NM+Z9svutvEnKitPqS8aH/ulNvefZswFO"
        "ALp0k1pP63A2Kw/QDKmnRA4VDXAWEDujIqJiwiIjw6Ki0iNih0VE8H+DPP83kgyuIX0NbBFDIodEOHV6AmizSKJCT2vCPRdb"
        "vLfUJKUBtIEmKbY+Xv0/YiLamHICbFq8END+VQZarya1IIsGarMh0sGwfCca5izSvcqgxUkKxRkVSZbXJ9auVQIapfDazXkA"
        "VeHq2gq0wbgUvVyyuLFsG3p9g3X59Q2OcvT6uqUreavizc5bOW/VvJl4M9cPV+l1SpLiO0DB4WIUpwh0GqD1DcaF+STBZg9G"
        "09KT0TpzXVmds25VXeVgvgenlqQAygBDfQiVq0URlKQYkgCetoEoiysZNAilQL67GnO684ICAQEBAQEBAQEBAQEBAQEBAQEB"
        "gRdOFUmqGBylSFxrqE90n/7BU8BqeCpoh6eEK1H3uaH7/BBtLNt2uWSx51ixtkKNq1CQV7sZp1AaKGvX1g83AAYFFKltMDrR"
        "wXWVdavqnHVldWY0OT0NHZzNEmR+g3GhngbTUILC0cPFANVQJEUqdXpVfQjjbpkPKDQIZZQ4iwZ6KgGCZCgSRVBtLuVMk6Wn"
        "yWXjZA5pxugUmSLdLhufKlWMdPBF8pg0mZ0pZFigs+YygK7AGYZkWJxiHUqA5pAUUZWaLJUrUOnYRLncfViaIEtDFdLaxeNk"
        "aKJ0VG3pf3FYmjgmJUGukCtGo7LDxSivBJ0gSxvDjzFTPjI9qcXD0mS5QoaOlaXWhygykvlhyRVj5SNlnraBaLo0YSw/fIUs"
        "011t7OnOC8YLCAgICAgICAgICAgICAgICAgIvHAcLKAYPc0ssusAS5OqOTaCLTQAh1qrx9mYaBuTjRvAkoAAK4Gz+D7j4FHt"
        "jvXZdR27ihwlLHe3Y8PP7jtXEV7OJX6Wj9wO2cM1wftUzwl97h7/CVMnikYNPL+D22BeZds3Yw/nq++7/1pg44lF925ia3ue"
        "UXRtdQxLgH589X33k7ekT0/s+ACzKXGGZJ4SOTQKimzjE7k4vS3X44bJFbf3uKTL1LnYivX+rlFXNmFD336d63t3m+S4XIPN"
        "La2Ju5Mh4aJu5XBBE6+6Tk7DJYOGF3N9osa5Gtr2c51hg7DVRydKyJs7JKn4AM6wM8C1fmsSVhPKYe0HmjjpF3sxm6waEwck"
        "YbvU8yWzdpW7tOW7MK7pHmbW5baosKyNVyB6d81lLC3DiZXd+1gSXrmau3ez7FPXS6FY6yYrZ0g5KLGoI2Oe8hAZAz209np4"
        "CUEQIyJBZiAPkFmPpjvVMdFZgNCAFmevDMYFRTzcKfLzfkAeefjhEbw0mslY6MBKUmwsbO3vbe1vRIos5GNdNr6GT9USP5G3"
        "TgBifMRXGhr1RKXH0yNq5a0Uep/v9AFvD3n7xavBI8Ety/2raX/eAnizkDHRTzh6PBwoqIdPNnRRBK8Rc65vGLbcJ8bxlR/i"
        "abif78dP5B/QSty6TWBQ23bBL7Xv0LFT5y5du3Xv0bPXy6+82rsP2jekX/8/vTYgdODrgwaHDQmPiIwaGv1GzJuxbw0bPiJO"
        "gsVLExJHykaNTpK//U5yimJM6p/TxqZnjMsc/+6EiZPeez9rMq5UEUCtySan5Gh1lN4wlWbY3Lz8gsJp02fMnFVkLJ49p2Tu"
        "vPkLSv+y8K9/W7T4g7IlHy5dtnzFylWr16xdt35DuclssdrsDmdFZVX1xk2bP9qyddv2HR///ZOduz7dvcfF1ez9rHbf/s8P"
        "fPHlwUOHvzpy9Otjx0/84+Q3dafqT585e+78hW//2XDxUuPl7640Xf3+X9f+/cP1H2/c/OnnW7fv3L13/8HDXx7Z1Fpc41tF"
        "VqVer/XNkW8i3TGyAZ2BLWx5rSEwpxA7o8K1ON1i4n3grdPGOy1B8WaKaNHbUpGfP+w4okf3s5Iz4VFYWNkKLhMM5KayF1yd"
        "di/j1ljOY/5XHrp2UE7JBlWJK27zQWyFXwVWzdL4FKBi9TQJmNkmSuxQ6bW5OoopNZNES9kjhh35ssW3GESw9IdlACxbwdIx"
        "NRfQhVkFLcdDDOMxWd0vBFOIg2syXsmIay8Ox74uNmKh4b25qjebsAb/Cu67dwdyhiw9NutaUtzQAUh8WFupRNQzhPNL3eva"
        "WLmQEy+0cHZlXyzpQBes13YbdipMylVHn8Km9//QFTPvS8xBA4P22TJeXn7OZU4awe05UCRxikuwrRf6S2Ibu3LdNlZxAWAb"
        "d2Izgp18byZWNyLUdbCklNtSlIXdvGjhTAtjuNb3e2Opog41I47vl0y53IULPHIhThO4Zk/n2wqJdEckNrd/AlfpjQYLCtjZ"
        "XiUWhqX5QBOgoIXF74t6j5bWuTvCld5hPbc/MfTXmjd3ngVCf1aWBPRzeQriW7XlrR1vwfCz+55Dpc1lWED/Xls/OBIR3FRF"
        "UJXvXYyWt2VfJkbbbuR8Y9spJScRSMHBw9Iuklc7ztxbI6VKMs3fn9kkfZASUTLxaLXUb3J6jyP5B6XWbJJlniXHJ8EXHPd1"
        "tUpPud/6wFlST5WYqGArrdeCPxSlYK/raPeDpz1vHZ6jtP7hWfX10hGuuU5PDMI9gM4wa7rAeHeFs92NN7uaBFqCmW8x6JnZ"
        "/MDymRp7Hq7NBUxLuwDsKft5dwExLFvDEu5tnrxDYMYgMHsQmE1ubDqyABBP61pX43coHnZgYmp/88qXRd7Wv7en+TVT36qZ"
        "2sBm6p4O0G+kJ/zWgMGAxMOBwbITLLvBsle8d+m9KK3LazyYqBcdjf/LQ8Osz3nROp94fPs8iv08WFiQ/ezeRc2ki5tldlCz"
        "TH6OnEGQDA8nMW/ZCHPoOrz+GauqdHMPs/E7BI3PcTKAZd3vgM2xsHjuIexbuHgoXAeYJSbcXLvbTgF+NyaKTQVL/7NCampt"
        "LMlqgdX98wbv1xbjrzrC9fk="
    )
)


def v20_state() -> miku.MikuState:
    state = make_state()
    state.header["created"] = V20_CREATED
    return state


def split_v21(data: bytes) -> tuple[dict, dict, bytes]:
    """(checksum record, meta, data area) of a v2.1 file."""
    _, major, minor, rec_len = _PREFIX.unpack_from(data)
    assert (major, minor) == (2, 1)
    start = _PREFIX.size + rec_len
    record = msgpack.unpackb(data[_PREFIX.size : start])
    meta_len = struct.unpack_from("<I", data, start)[0]
    meta = msgpack.unpackb(data[start + 4 : start + 4 + meta_len])
    return record, meta, data[start + 4 + meta_len :]


def frame_v21(meta: dict, area: bytes, algo: str = "crc32") -> bytes:
    """A v2.1 file around ``meta`` and ``area`` with a correct checksum."""
    packed = msgpack.packb(meta, use_bin_type=True)
    payload = struct.pack("<I", len(packed)) + packed + area
    hasher = _Hasher(algo)
    hasher.update(payload)
    record = msgpack.packb({"algo": algo, "digest": hasher.digest()})
    return _PREFIX.pack(miku.MAGIC, 2, 1, len(record)) + record + payload


# --------------------------------------------------------------------------- v2.0


def test_v20_file_reads_exactly(tmp_path: Path) -> None:
    assert V20_FILE[8:12] == struct.pack("<I", 2)  # the old single uint32 version field
    path = tmp_path / "old.miku"
    path.write_bytes(V20_FILE)
    assert file_version(path) == (2, 0)
    back = read_miku(path)
    assert_same(v20_state(), back)
    assert back.tensors["metric"].flags.writeable
    info = inspect_miku(path)
    assert info["format_minor"] == 0
    assert info["checksum"] == {"algo": "blake2b", "status": "ok"}


def test_v20_file_saved_again_is_v21_and_equal(tmp_path: Path) -> None:
    path = tmp_path / "s.miku"
    write_miku(path, decode_miku(V20_FILE))
    assert file_version(path) == (2, 1)
    assert_same(v20_state(), read_miku(path))


def test_v20_damage_is_detected() -> None:
    flipped = bytearray(V20_FILE)
    flipped[len(flipped) // 2] ^= 0x10
    with pytest.raises(MikuError, match="blake2b checksum does not match"):
        decode_miku(bytes(flipped))
    with pytest.raises(MikuError, match="checksum"):
        decode_miku(V20_FILE[: len(V20_FILE) - 7])


def test_newer_minor_version_is_refused_with_a_clear_message() -> None:
    data = bytearray(encode_miku(make_state()))
    data[10] = 2  # minor 2
    with pytest.raises(MikuError, match=r"format version 2\.2, newer than .* update ISAGI"):
        decode_miku(bytes(data))


# --------------------------------------------------------------------------- v2.1 layout


def test_texts_are_grouped_by_width_and_round_trip() -> None:
    texts = ["ascii", "latin-1 é ü", "bmp 意味", "astral 🤖", "", "ascii"]
    state = make_state()
    state.trajectories["query_text"] = texts
    state.trajectories["reply_text"] = list(reversed(texts))
    data = encode_miku(state)
    _, meta, _ = split_v21(data)
    groups = meta["strings"]["groups"]
    assert [g["encoding"] for g in groups] == ["latin-1", "utf-8", "utf-8"]
    assert all(g["sep"] is not None and g["lengths"] is None for g in groups)
    back = decode_miku(data)
    assert back.trajectories["query_text"] == texts
    assert back.trajectories["reply_text"] == list(reversed(texts))
    # each text is stored once: the table has no duplicates
    assert sum(g["count"] for g in groups) == meta["strings"]["n"]


def test_texts_holding_every_separator_are_cut_by_length() -> None:
    every = "".join(_SEPARATORS)
    texts = [every, "a" + every, "", "é" + every, "plain", "意" + every]
    state = make_state()
    state.trajectories["query_text"] = texts
    state.trajectories["reply_text"] = texts[::-1]
    data = encode_miku(state)
    _, meta, _ = split_v21(data)
    groups = meta["strings"]["groups"]
    assert any(g["sep"] is None and g["lengths"] is not None for g in groups)
    back = decode_miku(data)
    assert back.trajectories["query_text"] == texts
    assert back.trajectories["reply_text"] == texts[::-1]


def test_arrays_are_read_into_their_own_writable_memory() -> None:
    back = decode_miku(encode_miku(make_state()))
    arrays = [*back.tensors.values()] + [
        c for c in back.trajectories.values() if isinstance(c, np.ndarray)
    ]
    for arr in arrays:
        assert arr.flags.writeable and arr.dtype.isnative
        assert arr.flags.owndata  # not a view of a buffer shared with other arrays
    back.trajectories["query_x"][0, 0] = 42.0
    assert back.tensors["basis"][0, 0] != 42.0


@pytest.mark.parametrize("algo", ["crc32", "blake2b", "sha256"])
def test_every_named_checksum_is_written_and_verified(algo: str, tmp_path: Path) -> None:
    path = tmp_path / "s.miku"
    state = make_state()  # one state: its header's creation second is compared too
    write_miku(path, state, checksum=algo)
    assert inspect_miku(path)["checksum"] == {"algo": algo, "status": "ok"}
    assert_same(state, read_miku(path))
    data = bytearray(path.read_bytes())
    data[-3] ^= 0x01  # inside the data area
    path.write_bytes(data)
    with pytest.raises(MikuError, match=f"{algo} checksum does not match"):
        read_miku(path)


def big_state(n: int = 4000) -> miku.MikuState:
    """Thousands of distinct texts of every width (several MiB of text)."""
    rng = np.random.default_rng(5)
    words = ["plain", "ascii", "Über", "café", "意味", "🤖", "line\nbreak", "tab\t"]
    texts = [" ".join(rng.choice(words, 60)) + f" #{i}" for i in range(n)]
    state = make_state()
    state.trajectories = {
        "id": np.arange(n, dtype=np.int64),
        "query_x": rng.standard_normal((n, 4)).astype(np.float32),
        "query_text": texts,
        "reply_text": [t[::-1] for t in texts],
    }
    state.conversation = [
        {"role": "user", "text": t, "created": float(i)} for i, t in enumerate(texts)
    ]
    return state


def test_many_texts_of_every_width_round_trip() -> None:
    state = big_state()
    assert_same(state, decode_miku(encode_miku(state)))


def test_message_fields_on_any_rows_round_trip() -> None:
    state = make_state()
    n = len(state.conversation)
    for i, msg in enumerate(state.conversation):
        if i in (0, 1, 5, n - 1):
            msg["irregular"] = i * 1.5  # uneven rows
        if i == 3:
            msg["once"] = "only here"  # a single row
        if i % 3 == 2:
            msg["every_third"] = i  # evenly spaced, not from row 0
    back = decode_miku(encode_miku(state))
    assert back.conversation == state.conversation
    assert [sorted(m) for m in back.conversation] == [sorted(m) for m in state.conversation]


def test_checksum_is_verified_before_any_text_is_decoded(monkeypatch: pytest.MonkeyPatch) -> None:
    good = encode_miku(make_state())
    _, meta, area = split_v21(good)
    group = next(g for g in meta["strings"]["groups"] if g["encoding"] == "utf-8")
    bad = bytearray(good)
    bad[len(good) - len(area) + group["data"]["offset"] + 1] = 0xFF  # invalid UTF-8, bad checksum
    calls = []
    real = _Loaded.strings
    monkeypatch.setattr(
        _Loaded, "strings", lambda self, obj: calls.append(1) or real(self, obj)
    )
    with pytest.raises(MikuError, match="checksum does not match"):
        decode_miku(bytes(bad))
    assert calls == []  # damage is reported as damage, and nothing was decoded from it


def _tensor_nodes(node, path=()):
    if isinstance(node, dict):
        if set(node) == {"dtype", "shape", "offset"}:
            yield path, node
            return
        for k, v in node.items():
            yield from _tensor_nodes(v, (*path, k))
    elif isinstance(node, list):
        for i, v in enumerate(node):
            yield from _tensor_nodes(v, (*path, i))


@pytest.mark.parametrize(
    "damage, message",
    [
        ("gap", "starts at byte"),
        ("overlap", "starts at byte"),
        ("short_area", "tensors"),
        ("long_area", "the tensors cover"),
        ("offset_past_end", "outside the data area"),
        ("bad_utf8", "not valid utf-8"),
        ("count", "texts, expected"),
        ("both_sep_and_lengths", "exactly one of sep and lengths"),
        ("encoding", "is not one of"),
        ("string_total", "table declares"),
        ("bool_byte", "bytes other than 0 and 1"),
    ],
)
def test_layout_lies_behind_a_correct_checksum_are_refused(damage: str, message: str) -> None:
    _, meta, area = split_v21(encode_miku(make_state()))
    area = bytearray(area)
    nodes = sorted(_tensor_nodes(meta), key=lambda pn: pn[1]["offset"])
    big = [n for _, n in nodes if n["offset"] > 0 and np.prod(n["shape"]) > 0]
    groups = meta["strings"]["groups"]
    if damage == "gap":
        big[-1]["offset"] += 1
        area += b"\x00"
    elif damage == "overlap":
        big[-1]["offset"] -= 1
    elif damage == "short_area":
        del area[-1]
    elif damage == "long_area":
        area += b"\x00"
    elif damage == "offset_past_end":
        big[-1]["offset"] = len(area) + 100
    elif damage == "bad_utf8":
        g = next(g for g in groups if g["encoding"] == "utf-8")
        area[g["data"]["offset"]] = 0xFF
    elif damage == "count":
        groups[0]["count"] -= 1
        meta["strings"]["n"] -= 1
    elif damage == "both_sep_and_lengths":
        groups[0]["lengths"] = {"dtype": "int64", "shape": [0], "offset": 0}
    elif damage == "encoding":
        groups[0]["encoding"] = "utf-7"
    elif damage == "string_total":
        meta["strings"]["n"] += 1
    elif damage == "bool_byte":
        area[meta["tensors"]["flags"]["offset"]] = 2
    with pytest.raises(MikuError, match=message):
        decode_miku(frame_v21(meta, bytes(area)))
