"""The KV prefix store: the longest shared prefix wins, superseded and old entries go; a
context shift finds the entry that holds a prompt once the history window's dropped
exchanges are cut out of it."""

from __future__ import annotations

from isagi.engines.kv_prefix import (
    MIN_SHARED_TOKENS,
    MIN_SHIFTED_TOKENS,
    PrefixStore,
    shared_prefix,
    shifted_run,
)

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


# A conversation as token ids: the system prompt, then exchanges of 40 tokens each.
SYSTEM = list(range(1000, 1000 + MIN_SHARED_TOKENS + 4))


def exchange(i: int) -> list[int]:
    return [7, 8, *range(10_000 + 40 * i, 10_000 + 40 * i + 38)]  # every exchange opens with the same 2 tokens


def chat(first: int, last: int, tail: list[int]) -> list[int]:
    return [*SYSTEM, *[t for i in range(first, last) for t in exchange(i)], *tail]


def test_a_shift_cuts_out_the_dropped_exchanges() -> None:
    before = chat(0, 10, [5, 5, 5])  # the previous turn: exchanges 0-9, its message and reply
    after = chat(4, 10, [5, 5, 5, 6])  # the window dropped exchanges 0-3
    head = shared_prefix(tuple(before), after)
    assert head == len(SYSTEM) + 2, "the system prompt and the opening all exchanges share"
    cut, run = shifted_run(tuple(before), after, head)
    assert before[head:cut] == [t for i in range(4) for t in exchange(i)][2:] + [7, 8], "the gap"
    assert after[: head] + before[cut : cut + run] == after[: head + run] and run == len(after) - head - 1
    store = PrefixStore()
    store.put(before, b"kv")
    moved = store.best_shift(after)
    assert moved is not None and moved.data == b"kv" and (moved.head, moved.cut, moved.run) == (head, cut, run)
    assert moved.reused == len(after) - 1 > store.best(after)[2], "far more than the plain shared prefix"


def test_no_shift_without_a_long_run_or_a_shared_start() -> None:
    before = chat(0, 10, [])
    store = PrefixStore()
    store.put(before, b"kv")
    short = chat(9, 10, [])[: len(SYSTEM) + MIN_SHIFTED_TOKENS - 10]  # too little would be moved
    assert store.best_shift(short) is None
    other_system = [1, *chat(4, 10, [])[1:]]  # nothing shared at the front: nothing to keep
    assert store.best_shift(other_system) is None
    assert shifted_run(tuple(before), [*SYSTEM, 3, 3, 3], len(SYSTEM)) == (0, 0), "no continuation further on"
