"""A file uploaded the way the web app receives one, for tests of the handlers alone:
Gradio's upload route writes it into the upload cache under a folder of its own, and the
guard (:mod:`app.guard`) records it for the user who sent it."""

from __future__ import annotations

import secrets
import shutil
from pathlib import Path
from typing import Any


def upload(ui: Any, path: str | Path, owner: str = "local", name: str | None = None) -> str:
    """Put a copy of ``path`` into ``ui``'s upload cache as ``owner``'s upload; returns the
    path the upload route would have answered."""
    folder = ui.page.uploads.root / secrets.token_hex(8)
    folder.mkdir()
    dest = folder / (name or Path(path).name)
    shutil.copyfile(path, dest)
    assert ui.page.uploads.record(owner, owner, [str(dest)]) == [str(dest)]
    return str(dest)
