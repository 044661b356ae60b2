"""The web app's session registry: isolation, idle eviction (save then drop), resume,
forks on adoption, and the Regenerate snapshot. Fast: the real engine on a tiny random
model (tests/tiny_engine.py), real .miku files."""

from __future__ import annotations

import threading

import numpy as np
import pytest

from isagi.pipeline.events import Done
from isagi.session.files import load_session
from isagi.session.registry import SessionRegistry
from tests.tiny_engine import tiny_engine


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def engine(tmp_path):
    return tiny_engine(tmp_path, with_store=False)


@pytest.fixture
def clock():
    return Clock()


@pytest.fixture
def registry(engine, clock):
    return SessionRegistry(lambda: engine, idle_s=60, clock=clock)


def _turn(engine, session, text):
    return [ev for ev in engine.stream_turn(session, text) if isinstance(ev, Done)][0].turn


def test_sessions_are_isolated(registry, engine):
    a, b = registry.create(), registry.create()
    assert a != b
    sa, sb = registry.entry(a).session, registry.entry(b).session
    assert sa is not sb and sa.memory is not sb.memory and sa.metric is not sb.metric
    _turn(engine, sa, "what is a manifold?")
    assert len(sa.memory) == 1 and len(sb.memory) == 0
    assert sb.metric.growth == 0.0 and sa.metric.growth > 0
    # b asking the same question is not answered from a's memory
    res = _turn(engine, sb, "what is a manifold?")
    assert res.tier != "RETRIEVE"
    assert len(registry) == 2


def test_unknown_id_raises_and_ensure_creates(registry):
    with pytest.raises(KeyError):
        registry.entry("nope")
    with pytest.raises(KeyError):
        registry.entry(None)
    sid, entry = registry.ensure(None)
    assert sid in registry and entry.session.id == sid


def test_idle_eviction_saves_drops_and_resumes(registry, engine, clock):
    sid = registry.create()
    s = registry.entry(sid).session
    _turn(engine, s, "What is the boiling point of water?")
    _turn(engine, s, "How do plants make food?")
    path = s.miku_path
    path.unlink()  # prove that eviction itself writes the file
    clock.t += 61
    assert registry.evict_idle() == [sid]
    assert sid not in registry and len(registry) == 0
    assert path.exists()
    saved = load_session(engine.frame, path)
    assert saved.turns == s.turns
    # the next use resumes it from the file, transparently
    again = registry.entry(sid).session
    assert again is not s
    assert len(again.memory) == 2
    np.testing.assert_allclose(again.metric.M, s.metric.M)
    assert again.miku_path == path
    assert _turn(engine, again, "What is the boiling point of water?").tier == "RETRIEVE"


def test_recently_used_and_busy_sessions_are_not_evicted(registry, engine, clock):
    idle, busy, fresh = registry.create(), registry.create(), registry.create()
    for sid in (idle, busy):
        _turn(engine, registry.entry(sid).session, f"hello from {sid}")
    clock.t += 61
    registry.entry(fresh)  # touched just now
    entry = registry.entry(busy)
    clock.t += 1
    entry.last_used -= 100  # idle by the clock, but a turn holds it
    assert entry.lock.acquire(blocking=False)
    try:
        evicted = registry.evict_idle()
    finally:
        entry.lock.release()
    assert idle in evicted and busy not in evicted and fresh not in evicted
    assert busy in registry and fresh in registry


def test_empty_sessions_are_dropped_without_a_file(registry, engine, clock):
    sid = registry.create()
    path = registry.entry(sid).session.miku_path
    clock.t += 61
    assert registry.evict_idle() == [sid]
    assert not path.exists()
    assert registry.entry(sid).session.turns == []  # resumes as a fresh, empty session


def test_failed_save_keeps_the_session(engine, clock):
    def broken_save(*_args):
        raise OSError("disk full")

    reg = SessionRegistry(lambda: engine, idle_s=60, clock=clock, save=broken_save)
    sid = reg.create()
    _turn(engine, reg.entry(sid).session, "keep me")
    clock.t += 61
    assert reg.evict_idle() == []
    assert sid in reg and len(reg.entry(sid).session.memory) == 1


def test_release_saves_and_forgets(registry, engine):
    sid = registry.create()
    s = registry.entry(sid).session
    _turn(engine, s, "to be saved")
    s.miku_path.unlink()
    assert registry.release(sid)
    assert s.miku_path.exists()
    assert sid not in registry
    with pytest.raises(KeyError):
        registry.entry(sid)  # forgotten: the browser moved on


def test_adopt_never_shares_a_live_id(registry, engine):
    sid = registry.create()
    copy = engine.new_session(session_id=sid)
    new = registry.adopt(copy)
    assert new != sid and registry.entry(new).session is copy
    assert registry.entry(sid).session is not copy
    assert copy.miku_path.name == f"{new}.miku"
    other = engine.new_session(session_id="abc123")
    assert registry.adopt(other) == "abc123"  # a free id is kept (resume)
    third = engine.new_session(session_id="zzz999")
    assert registry.adopt(third, fresh_id=True) != "zzz999"  # uploads always fork


def test_stop_event_reaches_the_running_turn(tmp_path):
    from isagi.engines.hf.generation import GenerationOptions

    engine = tiny_engine(tmp_path, with_store=False)
    long = GenerationOptions(max_new_tokens=100_000, ignore_eos=True)
    reg = SessionRegistry(lambda: engine, idle_s=60)
    sid = reg.create()
    entry = reg.entry(sid)
    results = []

    def run():
        with reg.using(sid) as e:
            for ev in engine.stream_turn(e.session, "a long answer please", stop=e.stop, options=long):
                if isinstance(ev, Done):
                    results.append(ev.turn)

    t = threading.Thread(target=run)
    t.start()
    while not entry.lock.locked():
        pass
    assert reg.request_stop(sid) is True
    assert reg.wait_until_free(sid, timeout=30)
    t.join(30)
    assert results and results[0].verdict == "cancelled"
    assert results[0].new_tokens < 100_000


def test_snapshot_restores_metric_memory_and_turns(registry, engine):
    sid = registry.create()
    s = registry.entry(sid).session
    one, two = "What is the boiling point of water?", "How do plants make food?"
    _turn(engine, s, one)
    snap = s.checkpoint()
    M0 = s.metric.M.copy()
    _turn(engine, s, two)
    assert len(s.memory) == 2 and len(s.turns) == 2
    s.rollback(snap)
    assert len(s.memory) == 1 and len(s.turns) == 1
    np.testing.assert_allclose(s.metric.M, M0)
    assert s.memory.to_columns()["query_text"] == [one]
    assert _turn(engine, s, one).tier == "RETRIEVE"  # the restored memory still answers


def test_reaper_thread_evicts(engine):
    import time

    reg = SessionRegistry(lambda: engine, idle_s=0.05)
    sid = reg.create()
    _turn(engine, reg.entry(sid).session, "bye")
    reg.start_reaper(0.02)
    try:
        deadline = time.monotonic() + 10
        while sid in reg and time.monotonic() < deadline:
            time.sleep(0.02)
    finally:
        reg.stop_reaper()
    assert sid not in reg
    assert reg.evicted_total >= 1


def test_the_engines_saved_states_go_when_the_last_session_is_evicted_or_closed(registry, engine, clock,
                                                                                  monkeypatch):
    """Issue 37: nothing model-sized outlives the open sessions: the engine is told to forget its
    saved states when idle eviction or a closed page leaves no session live, not before."""
    calls: list[int] = []
    # (the tiny model is shared by the whole test run: the count is undone after the test)
    monkeypatch.setattr(engine.lm, "forget_saved_states", lambda: calls.append(1) or 0)
    a, b = registry.create(), registry.create()
    _turn(engine, registry.entry(a).session, "what is a manifold?")
    clock.t += 30
    registry.entry(b)
    clock.t += 40
    assert registry.evict_idle() == [a] and calls == []  # b is still live
    registry.attach("page-1", b)
    assert registry.detach("page-1", "local") == b  # its page closed: parked, nothing live
    assert calls == [1]
