"""The history window's block rule (:func:`isagi.manifold.window.window_start`), as a pure function."""

from __future__ import annotations

import random

import pytest

from isagi.manifold.window import KEEP_SHARE, window_start


def starts(costs: list[int], rooms: list[int], keep: float = KEEP_SHARE) -> list[int]:
    """The window start at every turn of a session growing one exchange at a time."""
    return [window_start(costs[: i + 1], rooms[: i + 1], keep) for i in range(len(costs))]


def test_a_history_within_the_room_is_kept_whole() -> None:
    assert window_start([], []) == 0
    assert window_start([30, 40, 50], [200, 200, 200]) == 0
    assert window_start([100, 100], [200, 200]) == 0, "exactly the room still fits"


def test_an_overflow_drops_the_oldest_exchanges_down_to_the_kept_share() -> None:
    # 10 exchanges of 30 tokens in a room of 200: the 7th overflows (210), and the oldest
    # leave until the history takes at most 100 tokens: 3 exchanges (90) stay.
    costs, rooms = [30] * 10, [200] * 10
    got = starts(costs, rooms)
    assert got[:6] == [0] * 6
    assert got[6] == 4 and sum(costs[4:7]) == 90
    assert got[6:] == [4] * 4, "then the start stays put while the history grows again"


@pytest.mark.parametrize("seed", range(5))
def test_the_start_only_moves_in_blocks_and_the_window_always_fits(seed: int) -> None:
    rng = random.Random(seed)
    n = 300
    costs = [rng.randint(10, 120) for _ in range(n)]
    rooms = [rng.randint(1500, 1900) for _ in range(n)]
    got = starts(costs, rooms)
    moves = 0
    for i in range(n):
        kept = sum(costs[got[i] : i + 1])
        assert kept <= rooms[i], "the window fits the room of its turn"
        previous = got[i - 1] if i else 0
        assert got[i] >= previous, "the start never moves back"
        if got[i] == previous:
            continue
        moves += 1
        assert sum(costs[previous : i + 1]) > rooms[i], "the start moves only when the history overflows"
        assert kept <= KEEP_SHARE * rooms[i] or got[i] == i, "a move drops a block: down to the kept share"
        assert sum(costs[got[i] - 1 : i + 1]) > KEEP_SHARE * rooms[i], "and no more than that"
    # each drop leaves at most the kept share, so the history grows by the rest of a room before
    # the next one: far fewer moves than turns once the budget is reached
    assert 0 < moves <= sum(costs) / (min(rooms) - KEEP_SHARE * max(rooms)) + 1 < n / 5


def test_the_start_is_a_function_of_the_exchanges_alone() -> None:
    rng = random.Random(7)
    costs = [rng.randint(10, 120) for _ in range(200)]
    rooms = [1800] * 200
    assert window_start(costs, rooms) == window_start(list(costs), list(rooms)), "same turns, same window"
    assert window_start(costs[:150], rooms[:150]) == starts(costs, rooms)[149], "replayed, not remembered"


def test_the_newest_exchange_stays_when_it_fits_the_room_alone() -> None:
    # the newest (150) is over the kept share of 100 but fits the room of 200: it stays, alone
    assert window_start([40, 40, 150], [200, 200, 200]) == 2


def test_an_exchange_larger_than_the_room_leaves_and_older_ones_never_come_back() -> None:
    assert window_start([40, 400], [200, 200]) == 2, "nothing fits beside it, and it does not fit itself"
    assert window_start([40, 400, 30], [200, 200, 200]) == 2, "the older exchange does not come back"


def test_a_turn_with_a_longer_message_has_less_room() -> None:
    # the same exchanges; only the room of the last turn (its message) differs
    assert window_start([50, 50, 50], [200, 200, 160]) == 0
    assert window_start([50, 50, 50], [200, 200, 140]) == 2


def test_bad_arguments_are_refused() -> None:
    with pytest.raises(ValueError, match="2 exchange costs but 1 rooms"):
        window_start([1, 2], [10])
    with pytest.raises(ValueError, match="share between 0 and 1"):
        window_start([1], [10], keep=1.5)
