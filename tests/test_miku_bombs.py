"""Hostile ``.miku`` files stay bounded: one-line MikuError, fast, and little memory.

The bounds (stated in docs/miku-format.md): reading a file of S bytes peaks below
8 * S + 32 MiB of traced memory (tracemalloc sees Python objects, numpy
arrays and msgpack's allocations); what it returns holds at most
MAX_TURNS turns and at most MAX_TEXT_CHARS characters of texts, each
counted at every message or row that uses it. Each case below writes a real
file whose checksum is correct, reads it under tracemalloc and checks the
bound, the error, and that it was refused before the work a bomb asks for
(seconds, not minutes; before this bound a 20 MB file of empty maps took
1.48 GB).
"""

from __future__ import annotations

import gc
import time
import tracemalloc
from collections.abc import Callable
from pathlib import Path

import pytest

from isagi.errors import MikuError
from isagi.session.files import SessionFrame
from isagi.storage import miku
from isagi.storage.miku import encode_miku, inspect_miku, read_miku
from tests import miku_bombs as B

MIB = 1024**2


def bound(size: int) -> int:
    return 8 * size + 32 * MIB


def measure(path: Path, read: Callable[[Path], object] = read_miku) -> tuple[int, float, object]:
    """(peak traced bytes, seconds, result or the MikuError) of reading ``path``."""
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    try:
        result: object = read(path)
    except MikuError as exc:
        result = exc
    finally:
        seconds = time.perf_counter() - t0
        peak = tracemalloc.get_traced_memory()[1]
        tracemalloc.stop()
    return peak, seconds, result


TOO_MANY = f"more than the limit of {miku.MAX_MESSAGES} ({miku.MAX_TURNS} turns"

REFUSED = {
    # name: (builder, what the message says)
    "20 MB of empty maps (v2.1 meta)": (lambda: B.empty_maps(20_000_000), "more than 400000 items"),
    "20 MB of empty maps (v2.0 payload)": (lambda: B.empty_maps(20_000_000, 0), "more than 400000 items"),
    "9 MB of 2-char strings": (lambda: B.many_short_strings(3_000_000), "more than 400000 items"),
    "9 MB of 2-char strings (v2.0)": (lambda: B.many_short_strings(3_000_000, 0), "more than 400000 items"),
    "a million nested arrays": (lambda: B.nested_arrays(1_000_000), "nested deeper than"),
    "array32 of 4G items": (lambda: B.declared("array32"), "more than 400000 items"),
    "map32 of 4G pairs": (lambda: B.declared("map32"), "more than 400000 items"),
    "str32 of 4 GB": (lambda: B.declared("str32"), "does not fit"),
    "bin32 of 4 GB": (lambda: B.declared("bin32"), "does not fit"),
    "extension type": (lambda: B.declared("ext"), "is not allowed"),
    "2M tiny messages (16 MB)": (lambda: B.messages(2_000_000), TOO_MANY),
    "2M tiny messages (v2.0)": (lambda: B.to_v20(B.messages(2_000_000)), TOO_MANY),
    "590k distinct short texts (4 MB)": (lambda: B.many_texts(590_000), "declares far more objects"),
    "a 30,000-turn session (6.5 MB)": (lambda: B.long_session(30_000), TOO_MANY),
    "a 1 MiB text as 2,000 messages": (lambda: B.amplified(2_000), "add up to more than"),
    "a 1 MiB text as 100 messages": (lambda: B.amplified(100), "add up to more than"),
    "a 1 MiB text as 100 messages (v2.0)": (lambda: B.to_v20(B.amplified(100)), "add up to more than"),
    "399,990 empty maps (under the item cap)": (lambda: B.empty_maps(399_990), "expected a map"),
}


@pytest.mark.parametrize("name", list(REFUSED))
def test_bombs_are_refused_in_one_line_within_the_memory_bound(tmp_path: Path, name: str) -> None:
    build, message = REFUSED[name]
    path = tmp_path / "bomb.miku"
    path.write_bytes(build())
    size = path.stat().st_size
    peak, seconds, result = measure(path)
    assert isinstance(result, MikuError), f"{name}: loaded"
    text = str(result)
    assert message in text and "\n" not in text and len(text) < 400
    assert peak <= bound(size), f"{name}: peak {peak} for {size} bytes"
    assert seconds < 10  # refused before the work it asks for (~0.01-0.7 s measured)
    # inspect (which reads a file whose checksum does not match) is bounded the same way
    peak, _, result = measure(path, inspect_miku)
    assert isinstance(result, MikuError) and peak <= bound(size)


LOADED = {
    "10k messages of two shared texts": lambda: B.messages(miku.MAX_MESSAGES),
    "10k messages of distinct texts": lambda: B.messages(miku.MAX_MESSAGES, distinct=True),
    "10k messages x 32 one-byte fields": lambda: B.messages(
        miku.MAX_MESSAGES, bool_fields=miku.MAX_MESSAGE_FIELDS
    ),
    "400k distinct short texts": lambda: B.many_texts(400_000),
    "one 40 MB text": lambda: B.one_text(40_000_000),
    "a 1 MiB text as 60 messages (60 Mi characters)": lambda: B.amplified(60),
    "a session at the turn limit": lambda: B.long_session(miku.MAX_TURNS),
}


@pytest.mark.parametrize("name", list(LOADED))
def test_densest_files_under_the_budget_load_within_the_memory_bound(tmp_path: Path, name: str) -> None:
    path = tmp_path / "dense.miku"
    path.write_bytes(LOADED[name]())
    size = path.stat().st_size
    peak, _, result = measure(path)
    assert isinstance(result, miku.MikuState), f"{name}: {result}"
    assert peak <= bound(size), f"{name}: peak {peak} for {size} bytes"


def test_a_real_session_at_the_turn_limit_loads_far_below_the_bound(tmp_path: Path) -> None:
    from isagi.bench.miku import synthetic_state

    state = synthetic_state(miku.MAX_TURNS, app_fields=True)
    path = tmp_path / "real.miku"
    path.write_bytes(encode_miku(state))
    size = path.stat().st_size
    assert size * 8 < miku.MAX_MIKU_BYTES  # the upload limit fits it with margin
    peak, _, result = measure(path)
    assert isinstance(result, miku.MikuState) and result.conversation == state.conversation
    assert peak <= 4 * size  # measured 2.6x at twice the turns


def _frame(d: int = 4) -> SessionFrame:
    """The frame of the bombs' header (model "m", fingerprint "f")."""
    return SessionFrame(model_id="m", model_fingerprint="f", hidden_size=d, layer=0, profile_key="", system_prompt="")


@pytest.mark.parametrize("refs", [100, 2_000])
def test_an_amplified_session_is_refused_before_its_texts_are_expanded(tmp_path: Path, refs: int) -> None:
    """A 1 MiB text stored once and used as the text of ``refs`` messages.

    The file is 1 MiB, but the session it holds is ``refs`` MiB of messages
    for whatever shows, stores or exports them; before the reader counted
    texts at each use it loaded (and the page of a server with a 4 GiB cap
    that showed the 2,000-message one was killed). Now it is refused by the
    loader the server calls, within the reader's bound and at once.
    """
    from isagi.session.files import load_session

    path = tmp_path / "amplified.miku"
    path.write_bytes(B.amplified(refs))
    size = path.stat().st_size
    assert size < 2 * MIB and refs * MIB > miku.MAX_TEXT_CHARS  # small file, large session
    peak, seconds, result = measure(path, lambda p: load_session(_frame(), p))
    assert isinstance(result, MikuError), "loaded"
    text = str(result)
    assert f"add up to more than {miku.MAX_TEXT_CHARS} characters" in text and "\n" not in text and len(text) < 300
    assert peak <= bound(size) and peak < 8 * MIB  # the table's one text, never the messages' copies
    assert seconds < 2  # measured 0.01 s


def test_a_large_session_within_the_text_limit_loads(tmp_path: Path) -> None:
    """60 MiB of messages from one stored text: large, but within MAX_TEXT_CHARS, so it loads."""
    from isagi.session.files import load_session

    path = tmp_path / "large.miku"
    path.write_bytes(B.amplified(60))
    peak, _, session = measure(path, lambda p: load_session(_frame(), p))
    assert not isinstance(session, MikuError), session
    assert [len(t.reply_text) for t in session.turns] == [MIB] * 30
    assert peak <= bound(path.stat().st_size)


def test_a_session_of_more_than_max_turns_is_refused_at_load(tmp_path: Path) -> None:
    """30,000 short turns: a 6.5 MB file (well within the size limit) whose every
    next turn would cost several times a turn; refused at load, at once. A
    session of MAX_TURNS turns loads, one more turn does not."""
    from isagi.session.files import load_session

    path = tmp_path / "long.miku"
    path.write_bytes(B.long_session(30_000))
    assert path.stat().st_size < miku.MAX_MIKU_BYTES / 8
    peak, seconds, result = measure(path, lambda p: load_session(_frame(), p))
    assert isinstance(result, MikuError) and "\n" not in str(result)
    assert f"60000 messages, {TOO_MANY}" in str(result)
    assert seconds < 2 and peak < MIB  # refused from the meta, before the data area is read
    path.write_bytes(B.long_session(miku.MAX_TURNS))
    session = load_session(_frame(), path)
    assert len(session.turns) == len(session.memory) == miku.MAX_TURNS
    path.write_bytes(B.long_session(miku.MAX_TURNS + 1))
    with pytest.raises(MikuError, match=r"more than the limit of \d+ \(\d+ turns"):
        load_session(_frame(), path)


def test_files_over_the_size_limit_are_refused_before_reading(tmp_path: Path) -> None:
    path = tmp_path / "big.miku"
    with path.open("wb") as f:
        f.truncate(miku.MAX_MIKU_BYTES + 1)  # sparse: nothing to read
    peak, seconds, result = measure(path)
    assert isinstance(result, MikuError) and "larger than the limit" in str(result)
    assert peak < MIB


@pytest.mark.parametrize("build", [lambda: B.empty_maps(2_000_000), lambda: B.messages(2_000_000)])
def test_cli_inspect_of_a_bomb_prints_one_line(tmp_path: Path, build) -> None:
    from typer.testing import CliRunner

    from isagi.cli import app

    path = tmp_path / "bomb.miku"
    path.write_bytes(build())
    result = CliRunner().invoke(app, ["inspect", str(path)])
    assert result.exit_code != 0
    assert "Traceback" not in result.output and result.output.strip().count("\n") == 0
    assert "is invalid" in result.output
