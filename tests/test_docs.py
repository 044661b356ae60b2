"""The text a newcomer reads points at what is in the repository: no reference to a design
document the repository does not hold (its definitions are in docs/architecture.md)."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_no_reference_to_a_design_document_outside_the_repository():
    files = [p for d in ("isagi", "storage", "app", "docs") for p in (ROOT / d).rglob("*")
             if p.suffix in (".py", ".md") and p.is_file()] + [ROOT / "README.md"]
    found = [f"{p.relative_to(ROOT)}:{n}" for p in files
             for n, line in enumerate(p.read_text(encoding="utf-8").splitlines(), 1)
             if re.search(r"DESIGN(\.md)? ?§", line)]
    assert not found, f"cite docs/architecture.md instead: {found}"
