"""``isagi bench balancer``'s arguments: what it needs is said before anything starts."""

from __future__ import annotations

import pytest

from isagi.bench.balancer import run
from isagi.errors import InputError


def test_it_needs_both_urls_or_a_database() -> None:
    with pytest.raises(InputError, match="--direct"):
        run("http://127.0.0.1:1", None)
    with pytest.raises(InputError, match="--db"):
        run(None, None)
    with pytest.raises(InputError, match="1 or more"):
        run("http://127.0.0.1:1", "http://127.0.0.1:2", users=(0,))
