"""The KV prefix store: the longest shared prefix wins, superseded and old entries go."""

from __future__ import annotations

from isagi.engines.kv_prefix import MIN_SHARED_TOKENS, PrefixStore, shared_prefix

BASE = list(range(100, 100 + MIN_SHARED_TOKENS))


def test_shared_prefix_counts_leading_equal_ids() -> None:
    assert shared_prefix((1, 2, 3), [1, 2, 4]) == 2
    assert shared_prefix((1, 2), [1, 2, 3]) == 2
    assert shared_prefix((), [1]) == 0
    assert shared_prefix((5,), [6]) == 0


def test_the_entry_sharing_the_longest_prefix_is_found() -> None:
    store = PrefixStore()
    store.put([*BASE, 1, 2], b"a")
    store.put([*BASE, 7, 8, 9], b"b")
    key, data, n = store.best([*BASE, 7, 8, 5])
    assert data == b"b" and n == len(BASE) + 2 and key == (*BASE, 7, 8, 9)
    assert store.best([9, *BASE]) is None  # nothing shared from the first token on
    assert store.best(BASE[: MIN_SHARED_TOKENS - 1]) is None  # too short to be worth a restore


def test_a_longer_conversation_supersedes_its_own_prefix() -> None:
    store = PrefixStore()
    store.put([*BASE, 1], b"xx")
    store.put([*BASE, 1, 2, 3], b"yyy")
    assert len(store) == 1 and store.nbytes == 3


def test_least_recently_used_entries_go_beyond_the_budget() -> None:
    store = PrefixStore(budget_bytes=10)
    store.put([*BASE, 1], b"1234")
    store.put([*BASE, 2], b"1234")
    store.best([*BASE, 1])  # used: now the most recent
    store.put([*BASE, 3], b"1234")
    assert store.nbytes <= 10 and len(store) == 2
    assert store.best([*BASE, 2])[2] == len(BASE)  # entry 2 is gone; only the shared base matches
    store.put([*BASE, 4], b"x" * 11)  # larger than the whole budget: not kept
    assert store.best([*BASE, 4])[0] != (*BASE, 4)
