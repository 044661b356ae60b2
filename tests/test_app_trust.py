"""Two users against a live app (uvicorn in this process, the tiny real engine, a real
SQLite history store, real .miku autosaves, Gradio's real routes): no server path a
client names is trusted, Gradio's session hashes and event ids belong to the login
that made them, and the upload cache stays within each user's quota.

bob names, in the file input of ``load_miku``, alice's autosaved session, a session
file that does not exist, the history database, a file outside the upload cache,
alice's own waiting upload (exactly, and by a ``..`` detour), a symlink in the cache
to alice's session, and a missing file in the cache: through ``gradio_client``,
through the queue by ``fn_index``, through Gradio's ``/call/`` API, through the
direct ``/run/`` route. Every answer is the same neutral sentence (whether or not the
path exists), nothing of alice's reaches bob or the cache, and alice's waiting
upload still loads for her afterwards.
"""

from __future__ import annotations

import contextlib
import hashlib
import io
import json
import os
import re
import socket
import stat
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest

from isagi.app.guard import OTHER_LOGIN, Bindings
from isagi.app.server import create_app
from isagi.app.uploads import MIB, NOT_YOUR_UPLOAD
from tests.gradio_raw import RawGradio, component_id
from tests.tiny_engine import tiny_engine

SECRET = "alice-secret-walrus-4471"


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


@contextlib.contextmanager
def serving(app: Any) -> Iterator[str]:
    """``app`` served by uvicorn on a free loopback port in a thread; yields its URL."""
    import uvicorn

    server = uvicorn.Server(uvicorn.Config(app, host="127.0.0.1", port=_free_port(), log_level="warning"))
    thread = threading.Thread(target=server.run, name="test-uvicorn", daemon=True)
    thread.start()
    deadline = time.monotonic() + 60
    while not server.started:
        assert thread.is_alive() and time.monotonic() < deadline, "the test server did not start"
        time.sleep(0.05)
    try:
        yield f"http://127.0.0.1:{server.config.port}/"
    finally:
        server.should_exit = True
        thread.join(30)


@contextlib.contextmanager
def logged_in(url: str, user: str, password: str) -> Iterator[httpx.Client]:
    """An HTTP client of the app with ``user``'s login cookie."""
    with httpx.Client(base_url=url, timeout=120) as http:
        assert http.post("login", data={"username": user, "password": password}).status_code == 200
        yield http


def upload_file(http: httpx.Client, path: Path, name: str | None = None) -> str:
    """Upload through Gradio's route as the page does; returns the path it answers."""
    with open(path, "rb") as f:
        r = http.post("gradio_api/upload", files=[("files", (name or path.name, f))])
    assert r.status_code == 200, r.text
    [answered] = r.json()
    return answered


def file_data(path: str, *, meta: bool = True) -> dict[str, Any]:
    d: dict[str, Any] = {"path": path, "orig_name": "x.miku"}
    if meta:
        d["meta"] = {"_type": "gradio.FileData"}
    return d


def note_of(outputs: Any) -> str:
    """The files note among an event's outputs (the first string that is not an id)."""
    return next(str(x) for x in outputs if isinstance(x, str) and len(x) > 12)


def cache_digests(root: Path) -> dict[str, str]:
    return {str(p): hashlib.sha256(p.read_bytes()).hexdigest()
            for p in root.rglob("*") if p.is_file() and not p.is_symlink()}


# --------------------------------------------------------------------------- the world


@pytest.fixture(scope="module")
def world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[dict[str, Any]]:
    """A live app with alice and bob; alice has a session holding SECRET (autosaved), a
    waiting upload, and a page session (her Gradio session hash)."""
    home = tmp_path_factory.mktemp("home")
    cache = tmp_path_factory.mktemp("gradio-cache")
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRADIO_TEMP_DIR", str(cache))
        engine = tiny_engine(home, auth="alice:a,bob:b", max_new_tokens=8)
        app = create_app(engine, engine.settings)
    # alice's waiting upload must outlive the module's tests (a slow run takes over the two
    # minutes after which an upload never opened is removed)
    app.state.isagi_uploads.ttl_s = 3600.0
    with serving(app) as url, logged_in(url, "alice", "a") as alice:
        raw_alice = RawGradio(alice, "alice", "a")
        send = next(d for d in raw_alice.deps() if d.get("api_name") == "send")
        data = [raw_alice.value_for(c, "") for c in send["inputs"]]
        data[0] = f"Remember {SECRET}, please."
        assert raw_alice.call(send, data, "alicehash0001")["success"]
        [sid] = app.state.isagi_registry.live_ids("alice")
        session_file = engine.settings.sessions_dir / f"{sid}.miku"
        assert session_file.is_file() and SECRET.encode() in session_file.read_bytes()
        waiting = upload_file(alice, session_file, "alice-notes.miku")
        other = tmp_path_factory.mktemp("elsewhere") / "outside.miku"
        other.write_bytes(session_file.read_bytes())
        yield {"url": url, "app": app, "engine": engine, "alice": alice, "raw_alice": raw_alice,
               "sid": sid, "session_file": session_file, "waiting": waiting, "outside": other,
               "cache": Path(cache).resolve(), "home": home}
    if engine.store is not None:
        engine.store.close()


def foreign_paths(w: dict[str, Any], bob_http: httpx.Client) -> dict[str, str]:
    """Every path bob tries, by what it is. bob's own upload gives the ``..`` detour its start."""
    cache: Path = w["cache"]
    mine = Path(upload_file(bob_http, w["outside"], "bob.miku"))
    link_dir = cache / "0123456789abcdef"
    link_dir.mkdir(exist_ok=True)
    link = link_dir / "link.miku"
    if not link.is_symlink():
        link.symlink_to(w["session_file"])
    waiting = Path(w["waiting"])
    return {
        "alice's session": str(w["session_file"]),
        "a session that does not exist": str(w["session_file"].with_name("000000000000.miku")),
        "the history database": str(Path(w["home"]) / "history.sqlite3"),
        "a file outside the cache": str(w["outside"]),
        "alice's waiting upload": str(waiting),
        "alice's upload by ..": str(mine.parent / ".." / waiting.parent.name / waiting.name),
        "a symlink in the cache": str(link),
        "a missing file in the cache": str(cache / "ffffffffffff" / "none.miku"),
        "a relative path": "sessions/x.miku",
    }


def assert_nothing_of_alices(w: dict[str, Any], before: dict[str, str]) -> None:
    """bob's sessions hold nothing of alice's, the cache gained no copy of her files, and her
    waiting upload is still there."""
    registry = w["app"].state.isagi_registry
    for sid in registry.live_ids("bob"):
        assert all(SECRET not in m["text"] for m in registry.entry(sid, "bob").session.messages)
    hers = hashlib.sha256(w["session_file"].read_bytes()).hexdigest()
    after = cache_digests(w["cache"])
    gained = {p: d for p, d in after.items() if p not in before}
    assert hers not in gained.values(), "a copy of alice's session appeared in Gradio's cache"
    assert Path(w["waiting"]).is_file(), "alice's waiting upload was not touched"


# --------------------------------------------------------------------------- file inputs


def test_bob_through_gradio_client_opens_no_path_and_every_answer_is_the_same(world) -> None:
    """A file object without Gradio's meta marker is passed by gradio_client as it is (with
    the marker, gradio_client reads the path on the *client* and uploads it: an ordinary
    upload of what the client can read)."""
    from gradio_client import Client

    bob = Client(world["url"], auth=("bob", "b"), verbose=False)
    with logged_in(world["url"], "bob", "b") as bob_http:
        paths = foreign_paths(world, bob_http)
    before = cache_digests(world["cache"])
    notes = {}
    for what, path in paths.items():
        out = bob.predict(file_data(path, meta=False), "tier", api_name="/load_miku")
        assert SECRET not in json.dumps(out, default=str), what
        notes[what] = note_of(out)
    assert set(notes.values()) == {f"⚠️ {NOT_YOUR_UPLOAD}"}, notes
    assert_nothing_of_alices(world, before)


def test_bob_by_fn_index_call_and_run_opens_no_path(world) -> None:
    """The same paths, with Gradio's meta marker (Gradio would copy any server file it can
    read into its cache first), through the queue by fn_index, the /call/ API and /run/."""
    with logged_in(world["url"], "bob", "b") as http:
        raw = RawGradio(http, "bob", "b")
        paths = foreign_paths(world, http)
        before = cache_digests(world["cache"])
        dep = next(d for d in raw.deps() if d.get("api_name") == "load_miku")
        upload_slot = dep["inputs"].index(component_id(raw, "isagi-upload"))
        notes: dict[str, set[str]] = {}
        for what, path in paths.items():
            for meta in (True, False):
                data = [raw.value_for(c, world["sid"]) for c in dep["inputs"]]
                data[upload_slot] = file_data(path, meta=meta)
                res = raw.call(dep, data, "bobhash0001")
                assert res.get("success") and SECRET not in json.dumps(res), (what, res)
                notes.setdefault(what, set()).add(note_of(res["output"]["data"]))
                # Gradio's simple API: POST /call/<name>, then read the event's stream
                r = http.post("gradio_api/call/load_miku", json={"data": [file_data(path, meta=meta), "tier"]})
                assert r.status_code == 200, r.text
                stream = http.get(f"gradio_api/call/load_miku/{r.json()['event_id']}").text
                assert SECRET not in stream and NOT_YOUR_UPLOAD in stream, (what, stream[:300])
                # the direct route (a queued event: Gradio itself refuses it, or it is refused the same)
                r = http.post("gradio_api/run/load_miku", json={"data": data, "session_hash": "bobhash0001"})
                assert SECRET not in r.text and (r.status_code == 404 or NOT_YOUR_UPLOAD in r.text), r.text
        assert all(n == {f"⚠️ {NOT_YOUR_UPLOAD}"} for n in notes.values()), notes
    assert_nothing_of_alices(world, before)


def test_own_uploads_load_once_and_alice_still_loads_hers(world) -> None:
    """The control: each user loads their own upload (once: the file is gone afterwards),
    and alice's waiting upload, tried by bob above, loads for her."""
    with logged_in(world["url"], "bob", "b") as http:
        raw = RawGradio(http, "bob", "b")
        dep = next(d for d in raw.deps() if d.get("api_name") == "load_miku")
        slot = dep["inputs"].index(component_id(raw, "isagi-upload"))
        mine = upload_file(http, world["outside"], "bobs-own.miku")
        data = [raw.value_for(c, "") for c in dep["inputs"]]
        data[slot] = file_data(mine)
        first = note_of(raw.call(dep, data, "bobhash0002")["output"]["data"])
        assert first.startswith("Loaded `bobs-own.miku`"), first
        assert not Path(mine).exists()
        again = note_of(raw.call(dep, data, "bobhash0002")["output"]["data"])
        assert again == f"⚠️ {NOT_YOUR_UPLOAD}", "an upload opens once"
    # gradio_client's own way: a local file, uploaded by the client, then loaded
    from gradio_client import Client, handle_file

    bob = Client(world["url"], auth=("bob", "b"), verbose=False)
    out = bob.predict(handle_file(str(world["outside"])), "tier", api_name="/load_miku")
    assert note_of(out).startswith("Loaded `outside.miku`"), out
    raw_alice = world["raw_alice"]
    dep = next(d for d in raw_alice.deps() if d.get("api_name") == "load_miku")
    data = [raw_alice.value_for(c, "") for c in dep["inputs"]]
    data[dep["inputs"].index(component_id(raw_alice, "isagi-upload"))] = file_data(world["waiting"])
    note = note_of(raw_alice.call(dep, data, "alicehash0001")["output"]["data"])
    assert note.startswith("Loaded `alice-notes.miku`: 1 trajectory, 1 turn."), note
    assert not Path(world["waiting"]).exists()


def test_no_path_of_the_server_in_errors_of_a_broken_upload(world) -> None:
    broken = Path(world["outside"]).with_name("my broken file.miku")
    broken.write_bytes(b"MIKU" + os.urandom(200))
    with logged_in(world["url"], "bob", "b") as http:
        raw = RawGradio(http, "bob", "b")
        dep = next(d for d in raw.deps() if d.get("api_name") == "load_miku")
        data = [raw.value_for(c, "") for c in dep["inputs"]]
        up = upload_file(http, broken)
        data[dep["inputs"].index(component_id(raw, "isagi-upload"))] = file_data(up)
        note = note_of(raw.call(dep, data, "bobhash0003")["output"]["data"])
    assert note.startswith("⚠️ Could not load my broken file.miku:"), note
    for server_path in (str(world["cache"]), str(world["home"]), Path(up).parent.name, "/tmp"):
        assert server_path not in note, (server_path, note)
    assert not Path(up).exists()


# --------------------------------------------------------------------------- session hashes


def test_a_session_hash_belongs_to_the_login_that_made_it(world) -> None:
    url, raw_alice = world["url"], world["raw_alice"]
    listing = next(d for d in raw_alice.deps() if d.get("api_name") == "list_sessions")
    assert raw_alice.call(listing, [""], "alicehash0002")["success"]
    with logged_in(url, "bob", "b") as bob, httpx.Client(base_url=url, timeout=30) as nobody:
        for client in (bob, nobody):
            r = client.get("gradio_api/queue/data", params={"session_hash": "alicehash0002"})
            assert r.status_code == 403 and r.json()["detail"] == OTHER_LOGIN, r.text
            body = {"data": [""], "fn_index": listing["id"], "session_hash": "alicehash0002"}
            assert client.post("gradio_api/queue/join", json=body).status_code == 403
            assert client.get("gradio_api/heartbeat/alicehash0002").status_code == 403
            # Gradio's deep links copy a session's page values (the chat) for anyone who names it
            assert client.get("gradio_api/deep_link", params={"session_hash": "alicehash0002"}).status_code == 403
            assert client.post("gradio_api/run/list_sessions", json=body).status_code == 403
            cancel = {"session_hash": "alicehash0002", "fn_index": listing["id"], "event_id": "x"}
            assert client.post("gradio_api/cancel", json=cancel).status_code == 403
        # bob's own hash works, and an event id from the /call/ API is its caller's only
        raw_bob = RawGradio(bob, "bob", "b")
        assert raw_bob.call(listing, [""], "bobhash0004")["success"]
        r = world["alice"].post("gradio_api/call/list_sessions", json={"data": [SECRET]})
        event = r.json()["event_id"]
        assert bob.get(f"gradio_api/call/list_sessions/{event}").status_code == 403
    stream = world["alice"].get(f"gradio_api/call/list_sessions/{event}")
    assert stream.status_code == 200 and world["sid"] in stream.text, "alice reads her own event"


@pytest.mark.parametrize("depth", [100_000, 65])
def test_a_deeply_nested_body_is_a_400_on_every_gradio_route(world, depth: int, caplog) -> None:
    """A body nested past Python's parser (100,000) or past any page event (65) is refused with one
    line, logged in or not; before, json.loads raised RecursionError: a 500 and a traceback."""
    body = ("[" * depth + "]" * depth).encode()
    event = b'{"data": ' + body + b', "fn_index": 0, "session_hash": "deephash0001"}'
    with httpx.Client(base_url=world["url"], timeout=30) as nobody:
        for client in (world["alice"], nobody):
            for route in ("queue/join", "run/predict", "call/send", "run/send"):
                for payload in (body, event):
                    caplog.clear()
                    r = client.post(f"gradio_api/{route}", content=payload,
                                    headers={"content-type": "application/json"})
                    assert r.status_code == 400 and "nested too deeply" in r.json()["detail"], (route, r.text[:200])
                    assert "Traceback" not in caplog.text
    # a page's own event still goes through
    listing = next(d for d in world["raw_alice"].deps() if d.get("api_name") == "list_sessions")
    assert world["raw_alice"].call(listing, [""], "alicehash0009")["success"]


def test_bindings_tie_a_key_to_its_first_login_and_stay_bounded() -> None:
    now = [0.0]
    b = Bindings(max_keys=3, ttl_s=100, clock=lambda: now[0])
    assert b.admit("h1", None) and b.holder("h1") is None, "no login ties nothing"
    assert b.admit("h1", "alice") and b.admit("h1", "alice") and b.holder("h1") == "alice"
    assert not b.admit("h1", "bob") and not b.admit("h1", None)
    now[0] = 150.0  # unused for longer than its time: free again
    assert b.admit("h1", "bob") and b.holder("h1") == "bob"
    for k in ("h2", "h3", "h4"):
        assert b.admit(k, "carol")
    assert len(b) == 3 and b.holder("h1") is None, "the least recently used goes first"


# --------------------------------------------------------------------------- the upload quota


def test_an_upload_flood_keeps_the_cache_within_the_quota(tmp_path) -> None:
    """bob sends ten 6 MiB uploads at once, then ten more one after another, never loading
    any, with a quota of 16 MiB: the cache (sampled every few milliseconds, each file
    counted once) never holds more than the quota, uploads beyond it are refused with the
    reason, and alice's upload meanwhile is untouched."""
    cache = tmp_path / "cache"
    cache.mkdir()
    quota = 16 * MIB
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("GRADIO_TEMP_DIR", str(cache))
        engine = tiny_engine(tmp_path / "home", auth="alice:a,bob:b", max_new_tokens=8, upload_quota_mb=16)
        app = create_app(engine, engine.settings)
    block = os.urandom(6 * MIB - 16)
    count = iter(range(1000))

    def payload() -> Path:
        """A fresh 6 MiB file (Gradio files uploads by their contents: each must differ)."""
        path = tmp_path / f"big{next(count)}.miku"
        path.write_bytes(f"{path.name:16}".encode() + block)
        return path
    peak = 0
    stop = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            seen: dict[tuple[int, int], int] = {}
            # os.walk skips a folder deleted mid-walk (Path.rglob raises, which ended this sampler
            # early once and left the peak unmeasured)
            for root, _dirs, files in os.walk(cache):
                for name in files:
                    with contextlib.suppress(OSError):
                        st = os.lstat(os.path.join(root, name))
                        if stat.S_ISREG(st.st_mode):
                            seen[(st.st_dev, st.st_ino)] = st.st_size
            peak = max(peak, sum(seen.values()))
            time.sleep(0.002)

    # "At once", made certain: each of bob's ten bodies stalls after its first chunk until the
    # server has taken all ten requests' headers (each reserves room in the quota then), so the
    # two that fit are still arriving when the other eight ask. Without it, a request whose
    # headers came after an earlier upload had finished would find room, and pass.
    ledger = app.state.isagi_uploads
    reserve, tried, all_tried = ledger.reserve, [], threading.Event()

    def counted(quota_key: str, nbytes: int) -> Any:
        try:
            return reserve(quota_key, nbytes)
        finally:
            if quota_key == "bob":
                tried.append(nbytes)
                if len(tried) >= 10:
                    all_tried.set()

    class Stalling(io.FileIO):
        def read(self, size: int = -1) -> bytes:
            if self.tell() > 0:
                all_tried.wait(60)
            return super().read(size)

    with serving(app) as url, logged_in(url, "alice", "a") as alice:
        small = tmp_path / "alice.miku"
        small.write_bytes(b"alice's upload")
        hers = upload_file(alice, small)
        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        statuses: list[int] = []
        ledger.reserve = counted  # type: ignore[method-assign]

        def one() -> None:
            with logged_in(url, "bob", "b") as bob, Stalling(payload(), "rb") as f:
                try:
                    statuses.append(bob.post("gradio_api/upload", files=[("files", ("big.miku", f))]).status_code)
                except httpx.TransportError:  # refused before its body was read: the connection closes
                    statuses.append(413)

        threads = [threading.Thread(target=one) for _ in range(10)]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        at_once = sorted(statuses)
        with logged_in(url, "bob", "b") as bob:
            for _ in range(10):
                with open(payload(), "rb") as f:
                    r = bob.post("gradio_api/upload", files=[("files", ("big.miku", f))])
                assert r.status_code == 200, r.text  # each new one removes the oldest waiting
        stop.set()
        sampler.join()
        assert peak >= 2 * 6 * MIB  # the sampler ran to the end: it saw at least bob's two waiting files
        ledger = app.state.isagi_uploads
        assert ledger.usage("bob") <= quota and len(ledger.waiting("bob")) == 2
        assert Path(hers).read_bytes() == b"alice's upload"
    assert at_once == [200] * 2 + [413] * 8, at_once  # two fit: 2 x 6 MiB < 16 MiB
    assert peak <= quota + len(b"alice's upload"), f"the cache held {peak / MIB:.1f} MiB"
    engine.store.close()


def test_the_page_cannot_ask_for_more_than_the_servers_limits(world) -> None:
    """ISAGI_MAX_NEW_TOKENS (8 here) wins over the page: the sliders end at it, a send event asking
    for 2,048 tokens is refused by the slider's own bounds (before: a 2,048-token reply), and one
    at the slider's end gets a reply of at most 8 tokens."""
    raw = world["raw_alice"]
    sliders = {c["props"].get("elem_id") or c["props"].get("label"): c["props"] for c in raw.components.values()
               if c.get("type") == "slider"}
    assert sliders["isagi-max-tokens"]["maximum"] == 8
    assert sliders["Tokens per step"]["maximum"] == 8
    send = next(d for d in raw.deps() if d.get("api_name") == "send")
    data = [raw.value_for(c, "") for c in send["inputs"]]
    names = [raw.components[c]["props"].get("elem_id") or raw.components[c]["props"].get("label") for c in send["inputs"]]
    data[0] = "Tell me a very long story about the sea."
    data[names.index("Sample (otherwise greedy)")] = True
    registry = world["app"].state.isagi_registry
    before = set(registry.live_ids("alice"))
    data[names.index("isagi-max-tokens")] = 2048
    refused = raw.call(send, data, "alicehash0011")
    assert not refused.get("success") and set(registry.live_ids("alice")) == before, refused
    data[names.index("isagi-max-tokens")] = 8
    assert raw.call(send, data, "alicehash0012")["success"]
    [sid] = set(registry.live_ids("alice")) - before
    turn = registry.entry(sid, "alice").session.turns[-1]
    assert turn.generated and 1 <= turn.new_tokens <= 8, turn


def test_the_engine_clamps_every_generation_option_to_the_server(tmp_path) -> None:
    import math

    from isagi.engines.base import GenerationOptions, within_limits

    engine = tiny_engine(tmp_path, with_store=False, max_new_tokens=8)
    s = engine.new_session(autosave=False)
    t = engine.turn(s, "hello there", options=GenerationOptions(max_new_tokens=2048, ignore_eos=True))
    assert t.new_tokens == 8, "decoded to the server's limit, not the request's"
    o = within_limits(GenerationOptions(max_new_tokens=0, temperature=math.nan, top_p=5.0, top_k=-3,
                                        repetition_penalty=math.inf), 8)
    assert (o.max_new_tokens, o.temperature, o.top_p, o.top_k, o.repetition_penalty) == (1, 0.7, 1.0, 0, 1.0)


def _download_of(outputs: Any) -> dict[str, Any]:
    """The file object among an event's outputs (Save .miku, an export)."""
    found = [o for o in outputs["data"] if isinstance(o, dict) and o.get("path") and o.get("url")]
    assert len(found) == 1, outputs
    return found[0]


def test_a_download_is_served_to_its_owner_only_and_names_no_words_of_the_chat(world) -> None:
    """Save .miku and an export hand out files that only their login fetches (bob 404, no login
    401; before: 200 with the whole session), named by session id and date, not by the chat's
    words (before: isagi-remember-<secret>-....miku)."""
    from gradio.processing_utils import hash_file

    raw = world["raw_alice"]
    save = next(d for d in raw.deps() if d.get("api_name") == "save_miku")
    export = next(d for d in raw.deps() if d.get("api_name") == "export_json")
    got = raw.call(save, [raw.value_for(c, world["sid"]) for c in save["inputs"]], "alicehash0001")
    assert got["success"], got
    miku = _download_of(got["output"])
    got = raw.call(export, [raw.value_for(c, world["sid"]) for c in export["inputs"]], "alicehash0001")
    assert got["success"], got
    exported = _download_of(got["output"])
    for f in (miku, exported):
        name = Path(f["path"]).name
        assert re.fullmatch(r"isagi-[0-9a-f]{12}-\d{8}\.(miku|json)", name), name
        assert "walrus" not in f["url"].lower() and "remember" not in f["url"].lower()
        # the page recorded the very path Gradio serves (its cache: the file's hash, then its name)
        assert Path(f["path"]).parent.name == hash_file(f["path"])
    waiting = upload_file(world["alice"], world["session_file"], "alice-fresh.miku")
    url = f"gradio_api/file={miku['path']}"
    mine = world["alice"].get(url)
    assert mine.status_code == 200 and SECRET.encode() in mine.content
    with logged_in(world["url"], "bob", "b") as bob, httpx.Client(base_url=world["url"], timeout=30) as nobody:
        for f in (miku, exported):
            theirs = bob.get(f"gradio_api/file={f['path']}")
            assert theirs.status_code == 404 and SECRET.encode() not in theirs.content
            assert nobody.get(f"gradio_api/file={f['path']}").status_code == 401
        # and alice's waiting upload, by its URL
        assert bob.get(f"gradio_api/file={waiting}").status_code == 404
        assert nobody.get(f"gradio_api/file={waiting}").status_code == 401
        # Gradio's older file route serves the same files: the same answers (before: 200 for bob)
        for path in (miku["path"], exported["path"], waiting):
            theirs = bob.get(f"gradio_api/file/{path}")
            assert theirs.status_code == 404 and SECRET.encode() not in theirs.content, path
            assert nobody.get(f"gradio_api/file/{path}").status_code == 401
    assert world["alice"].get(f"gradio_api/file={waiting}").status_code == 200
    assert world["alice"].get(f"gradio_api/file/{waiting}").status_code == 200


def test_a_file_in_gradios_cache_that_nobody_was_handed_is_served_to_nobody(world) -> None:
    """A download or upload a killed server left in Gradio's cache is recorded for nobody (the
    ledger lives in memory): it is a 404 for every login on both file routes (before: 200 for
    any login that had the URL, for as long as the file stayed)."""
    left = world["cache"] / ("0" * 40) / "isagi-0123456789ab-20261128.json"
    left.parent.mkdir(parents=True, exist_ok=True)
    left.write_text(f'{{"said": "{SECRET}"}}', encoding="utf-8")
    with logged_in(world["url"], "bob", "b") as bob:
        for client in (world["alice"], bob):
            for url in (f"gradio_api/file={left}", f"gradio_api/file/{left}"):
                r = client.get(url)
                assert r.status_code == 404 and SECRET.encode() not in r.content, url


def test_an_event_call_that_does_not_fit_its_inputs_is_a_400_with_no_traceback(world, caplog) -> None:
    """Data Gradio would raise on (a 500 and 20-90 traceback lines each) is refused with one line:
    too few values, a string for a slider, a slider past its end, a choice the radio lacks, a
    body without data, by every route that runs an event; the page's own calls still go."""
    raw = world["raw_alice"]
    deps = {d.get("api_name"): d for d in raw.deps()}
    send, explore = deps["send"], deps["explore"]
    good = [raw.value_for(c, "") for c in send["inputs"]]
    good[0] = "What is a manifold?"
    names = [raw.components[c]["props"].get("elem_id") or raw.components[c]["props"].get("label")
             for c in send["inputs"]]
    kinds = [raw.components[c]["type"] for c in send["inputs"]]
    bad_joins = [good[:1], [*good[:2], "abc", *good[3:]], [*good[:2], 10**6, *good[3:]],
                 [*good[:-1], "rainbow"], [*good[:3], "yes", *good[4:]]]
    assert names[2] == "isagi-max-tokens" and kinds[3] == "checkbox" and kinds[-1] == "radio"
    explore_api = [v for v, c in zip(["ocean", 100, 8], explore["inputs"], strict=True)]
    for_routes = [
        ("queue/join", {"fn_index": send["id"], "data": d, "session_hash": "alicehash0021"}) for d in bad_joins
    ] + [
        ("queue/join", {"fn_index": 9999, "data": [], "session_hash": "alicehash0021"}),
        ("run/explore", {"data": explore_api}),
        ("run/explore", {"data": ["ocean", "abc", 8]}),
        ("call/explore", {"data": ["ocean"]}),
        ("call/send", {"x": 1}),
        ("call/v2/send", {}),
        ("call/v2/send", {"message": "hi", "nonsense": 1}),
    ]
    for route, body in for_routes:
        caplog.clear()
        r = world["alice"].post(f"gradio_api/{route}", json=body)
        assert r.status_code == 400 and "does not fit" in r.json()["detail"], (route, body, r.text[:200])
        assert "Traceback" not in caplog.text
    assert raw.call(send, good, "alicehash0022")["success"]


def test_a_handed_out_download_is_removed_after_its_time(tmp_path) -> None:
    from isagi.app.uploads import DOWNLOAD_TTL_S, UploadLedger

    now = [0.0]
    ledger = UploadLedger(tmp_path, 1 << 20, clock=lambda: now[0])
    folder = tmp_path / "abc123"
    folder.mkdir()
    f = folder / "isagi-x.miku"
    f.write_bytes(b"x")
    assert ledger.hand_out("alice", f) and ledger.holders(str(f)) == {"alice"}
    assert ledger.holders(str(tmp_path / "other.miku")) is None and ledger.holders("/etc/passwd") is None
    now[0] = DOWNLOAD_TTL_S / 2
    ledger.sweep()
    assert f.is_file()
    now[0] = DOWNLOAD_TTL_S + 1
    ledger.sweep()
    assert not f.exists() and not folder.exists() and ledger.holders(str(f)) is None


def test_an_upload_that_holds_no_file_is_a_400(world) -> None:
    """A multipart body without a 'files' part, or with a part cut off, gave 200 and [] (nothing
    was uploaded, nothing said why); now a 400 saying what to send. A real upload still goes."""
    alice = world["alice"]
    no_files = alice.post("gradio_api/upload", files=[("other", ("x.miku", b"abc"))])
    assert no_files.status_code == 400 and "no file" in no_files.json()["detail"], no_files.text
    cut = b'--XyZ\r\nContent-Disposition: form-data; name="files"; filename="a.miku"\r\n\r\nabc'
    r = alice.post("gradio_api/upload", content=cut,
                   headers={"content-type": "multipart/form-data; boundary=XyZ", "content-length": str(len(cut))})
    assert 400 <= r.status_code < 500, (r.status_code, r.text[:200])
    assert upload_file(alice, world["session_file"], "alice-again.miku")
