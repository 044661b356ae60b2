"""The writer writes nothing its reader refuses: each limit, both sides, one check.

For every limit of ``storage.miku`` (set in ``storage.miku.limits``) a session just over it is refused by
``write_miku`` with the reader's own reason, and nothing is written (a file
already there is unchanged, no temporary file is left). The same session,
written with that limit lifted, is refused by ``read_miku`` with the limit
back in place and the same reason: the two sides run the same checks, so a
limit changed on one side is changed on both.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import numpy as np
import pytest

from isagi.errors import MikuError
from isagi.storage import miku
from isagi.storage.miku import MikuState, limits, read_miku, write_miku
from tests.test_miku import make_state

MIB = 1024**2


def _messages(n: int, **fields: Any) -> Callable[[MikuState], None]:
    def change(state: MikuState) -> None:
        state.conversation = [{"role": "user", "text": "", **fields} for _ in range(n)]

    return change


def _set(section: str, key: str, value: Any) -> Callable[[MikuState], None]:
    return lambda state: getattr(state, section).__setitem__(key, value)


def _trajectories(n: int) -> Callable[[MikuState], None]:
    def change(state: MikuState) -> None:
        state.trajectories = {"id": np.arange(n, dtype=np.int64)}

    return change


def _text_columns(rows: int, columns: int) -> Callable[[MikuState], None]:
    """``rows`` trajectories with ``columns`` text columns of distinct short texts."""

    def change(state: MikuState) -> None:
        state.trajectories = {f"t{j}": [f"{j}:{i}" for i in range(rows)] for j in range(columns)}

    return change


def _nested(depth: int) -> dict:
    node: dict = {}
    for _ in range(depth):
        node = {"a": node}
    return node


def _one_text_everywhere(where: str) -> Callable[[MikuState], None]:
    """A 1 MiB text stored once, used 65 times (65 Mi characters) in one kind of place."""
    text = "t" * MIB

    def change(state: MikuState) -> None:
        state.trajectories = {}
        state.conversation = [{"role": "user", "text": ""}] * 65
        if where == "message":
            state.conversation = [{"role": "user", "text": text}] * 65
        elif where == "field":
            state.conversation = [{"role": "user", "text": "", "nearest_query": text}] * 65
        else:
            state.trajectories = {"query_text": [text] * 65}

    return change


# name: (change to make_state(), its reason (in both messages), the limits to lift to write
# it anyway, the limits lowered for the case)
CASES: dict[str, tuple[Callable[[MikuState], None], str, dict[str, Any], dict[str, Any]]] = {
    "file size": (lambda s: None, "larger than the limit of 10000 bytes",
                  {"MAX_MIKU_BYTES": 10**9}, {"MAX_MIKU_BYTES": 10_000}),
    "turns (messages)": (_messages(miku.MAX_MESSAGES + 1), f"{miku.MAX_MESSAGES + 1} messages, more than the limit of {miku.MAX_MESSAGES}",
                         {"MAX_MESSAGES": 10**6}, {}),
    "trajectories": (_trajectories(miku.MAX_TRAJECTORIES + 1), f"{miku.MAX_TRAJECTORIES + 1} rows, more than the limit of {miku.MAX_TRAJECTORIES}",
                     {"MAX_TRAJECTORIES": 10**6}, {}),
    "texts counted at each use: messages": (
        _one_text_everywhere("message"), f"conversation.text: its texts add up to more than {miku.MAX_TEXT_CHARS}",
        {"MAX_TEXT_CHARS": 10**12}, {}),
    "texts counted at each use: a message field": (
        _one_text_everywhere("field"), "conversation.fields['nearest_query']: its texts add up to more than",
        {"MAX_TEXT_CHARS": 10**12}, {}),
    "texts counted at each use: a trajectory column": (
        _one_text_everywhere("column"), "trajectories['query_text']: its texts add up to more than",
        {"MAX_TEXT_CHARS": 10**12}, {}),
    "distinct texts": (lambda s: None, "texts, more than the limit of 10",
                       {"MAX_STRINGS": 10**6}, {"MAX_STRINGS": 10}),
    "message fields": (_messages(2, **{f"f{j}": j for j in range(33)}), "33 message fields, more than the limit of 32",
                       {"MAX_MESSAGE_FIELDS": 100}, {}),
    "object budget": (_text_columns(5_000, 100), "declares far more objects",
                      {"OBJECT_BUDGET_BYTES": 10**9}, {}),
    "meta items": (_set("extra", "big", [[0] * 200_001, [0] * 200_001]), "holds more than 400000 items",
                   {"MAX_META_ITEMS": 10**6}, {}),
    "a string of the meta (a 5 MB title)": (_set("extra", "title", "x" * 5_000_000),
                                            "a string of 5000000 bytes, more than the limit of 4194304",
                                            {"MAX_STR_BYTES": 10**8}, {}),
    "map entries": (_set("extra", "settings", {f"k{i}": i for i in range(10_001)}),
                    "a map of 10001 entries, more than the limit of 10000", {"MAX_MAP_LEN": 10**6}, {}),
    "nesting of the extra settings": (_set("extra", "deep", _nested(9)), "nested deeper than 8 levels",
                                      {"MAX_EXTRA_DEPTH": 100}, {}),
    "name length": (_set("tensors", "n" * 257, np.zeros(1)), "invalid name", {"MAX_NAME_LEN": 1000}, {}),
    "tensor dimensions": (_set("tensors", "nine", np.zeros((1,) * 9)), "shape must be a list of at most 8 sizes",
                          {"MAX_NDIM": 32}, {}),
    "tensor size": (_set("tensors", "wide", np.zeros((0, 2**31 + 1), np.float32)), "has an invalid size",
                    {"MAX_TENSOR_ELEMENTS": 2**40}, {}),
}


@pytest.mark.parametrize("name", list(CASES))
def test_the_writer_refuses_each_limit_as_the_reader_does_and_writes_nothing(
    tmp_path: Path, name: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    change, reason, lift, lower = CASES[name]
    path = tmp_path / "s.miku"
    write_miku(path, make_state())
    before = path.read_bytes()
    for key, value in lower.items():
        monkeypatch.setattr(limits, key, value)
    state = make_state()
    change(state)
    with pytest.raises(MikuError) as written:
        write_miku(path, state)
    assert reason in str(written.value) and "\n" not in str(written.value)
    assert path.read_bytes() == before  # the file there is unchanged
    assert sorted(p.name for p in tmp_path.iterdir()) == ["s.miku"]  # no temporary file left
    # the same session written with the limit lifted: the reader refuses it, for the same reason
    other = tmp_path / "lifted" / "s.miku"
    with monkeypatch.context() as m:
        for key, value in lift.items():
            m.setattr(limits, key, value)
        write_miku(other, state)
    with pytest.raises(MikuError) as read:
        read_miku(other)
    assert reason in str(read.value) and "\n" not in str(read.value)


def test_the_writer_counts_the_size_of_the_file_exactly(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    """The size limit (and the memory budget, which grows with the size) apply to the same number of bytes."""
    size = len(miku.encode_miku(make_state()))
    monkeypatch.setattr(limits, "MAX_MIKU_BYTES", size)
    write_miku(tmp_path / "fits.miku", make_state())
    assert (tmp_path / "fits.miku").stat().st_size == size
    monkeypatch.setattr(limits, "MAX_MIKU_BYTES", size - 1)
    with pytest.raises(MikuError, match=f"it is {size} bytes, larger than the limit of {size - 1} bytes"):
        write_miku(tmp_path / "over.miku", make_state())
    assert not (tmp_path / "over.miku").exists()


def test_a_session_at_every_limit_is_written_and_read_back(tmp_path: Path) -> None:
    """At the limits: MAX_TURNS turns, each message with MAX_MESSAGE_FIELDS fields, MAX_TRAJECTORIES
    rows, and texts just under MAX_TEXT_CHARS (100 texts, each used by 100 messages)."""
    state = make_state()
    n = miku.MAX_MESSAGES
    per_message = miku.MAX_TEXT_CHARS // n - 16  # room for the roles' characters
    texts = [f"{i % 100:08d}" + "m" * (per_message - 8) for i in range(n)]
    state.conversation = [
        {"role": ("user", "assistant")[i % 2], "text": texts[i], **{f"f{j}": i + j for j in range(miku.MAX_MESSAGE_FIELDS)}}
        for i in range(n)
    ]
    state.trajectories = {"id": np.arange(miku.MAX_TRAJECTORIES, dtype=np.int64)}
    path = tmp_path / "s.miku"
    write_miku(path, state)
    back = read_miku(path)
    assert back.conversation == state.conversation and back.n_trajectories == miku.MAX_TRAJECTORIES
    assert sum(len(m["text"]) + len(m["role"]) for m in back.conversation) <= miku.MAX_TEXT_CHARS
