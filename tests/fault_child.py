"""A process that chats and gets killed, for tests/test_faults.py.

    python -m tests.fault_child HOME MODE [TURNS]

Opens the data directory as ``isagi chat`` does (:func:`isagi.datadir.open_data_dir`),
starts the real engine on the tiny model (history store and autosave as
``Engine.start`` sets them up) and runs turns in one session, printing
``kept N`` once turn N is kept (its ``keep`` returned). ``MODE``:

- ``free``: turns until killed;
- ``before-rename``: after TURNS turns, the next save stops with its temporary
  file written and synced, just before the rename (prints ``blocked``);
- ``before-history``: after TURNS turns, the next turn stops with its file
  written, just before its history rows are committed (prints ``blocked``).

The parent kills it with SIGKILL, so nothing of Python's shutdown runs.
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path


def _block(*_a: object, **_k: object) -> None:
    print("blocked", flush=True)
    time.sleep(3600)


def _replace_but_block_miku(real):
    return lambda src, dst: _block() if str(dst).endswith(".miku") else real(src, dst)


def main(argv: list[str]) -> None:
    home, mode = Path(argv[0]), argv[1]
    turns = int(argv[2]) if len(argv) > 2 else 3

    from isagi.datadir import open_data_dir
    from tests.tiny_engine import tiny_engine, tiny_settings

    data = open_data_dir(tiny_settings(home))
    engine = tiny_engine(home, max_new_tokens=6)
    session = engine.new_session()
    session.miku_path = engine.settings.sessions_dir / f"{session.id}.miku"
    print(f"session {session.id}", flush=True)
    i = 0
    while True:
        if i == turns and mode == "before-rename":
            os.replace = _replace_but_block_miku(os.replace)
        if i == turns and mode == "before-history":
            engine.store.record_exchange = engine.store.record_exchanges = _block
        engine.turn(session, f"message number {i}:" + " words" * (i % 7))
        print(f"kept {i}", flush=True)
        i += 1
    data.close()  # never reached: killed


if __name__ == "__main__":
    main(sys.argv[1:])
