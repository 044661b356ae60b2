"""The page through HAProxy in front of two ``isagi web`` replicas on one PostgreSQL store
(marker ``replicas``; :mod:`tests.replica_cluster`), in Chromium, on the real default model.

A conversation sticks to one replica (the balancer's cookie: every response of the page comes
from it); that replica is killed (SIGKILL); a reload lands on the other one, which shows the
same chat (the same session id and messages, read from the shared store), and the next turn
works there: the first question again is answered from memory (RETRIEVE).
"""

from __future__ import annotations

import time

import pytest

from tests.e2e.conftest import open_page, wait_ready
from tests.e2e.test_reload import user_messages
from tests.e2e.test_web_e2e import send_and_wait, session_id, wait_text
from tests.replica_cluster import REPLICA, cluster, file_turns, history_exchanges

pytestmark = [pytest.mark.replicas, pytest.mark.browser, pytest.mark.model, pytest.mark.postgres]

QUESTIONS = ["What is a lighthouse for?", "Why is the sea salty?", "Name a bird that cannot fly."]


@pytest.fixture(scope="module")
def web_lb(tmp_path_factory: pytest.TempPathFactory):
    with cluster(tmp_path_factory.mktemp("replicas-web"), "web", env={"ISAGI_MAX_NEW_TOKENS": "24"}) as c:
        yield c


def test_a_killed_replicas_chat_reloads_on_the_other_and_goes_on(web_lb, context_of, screenshot_dir) -> None:
    ctx = context_of()
    # (when the request began, epoch ms; the replica that answered), of the app's own answers
    answered: list[tuple[float, str]] = []

    def seen(response) -> None:
        name = response.headers.get(REPLICA.lower())
        if name and not any(f"/{d}/" in response.url for d in ("assets", "static")):  # the browser caches those
            answered.append((response.request.timing["startTime"], name))

    def answered_by(since_ms: float = 0.0) -> set[str]:
        return {name for began, name in answered if began >= since_ms}

    ctx.on("response", seen)
    page = open_page(ctx, web_lb.url + "/")
    for q in QUESTIONS:
        assert send_and_wait(page, q) != "RETRIEVE"
    sid = session_id(page)
    before = user_messages(page)
    assert len(answered_by()) == 1, answered  # the cookie kept the page on one replica
    holder = answered_by().pop()
    assert ctx.request.get(web_lb.url + "/health").headers[REPLICA.lower()] == holder

    web_lb.replica(holder).kill()
    killed_ms = time.time() * 1000
    page.reload()
    wait_ready(page)
    wait_text(page, "#isagi-manifold-summary", sid)  # the same session, reopened from the shared store
    assert user_messages(page) == before
    moved_to = ctx.request.get(web_lb.url + "/health").headers[REPLICA.lower()]
    assert moved_to != holder
    assert send_and_wait(page, QUESTIONS[0]) == "RETRIEVE"  # its memory moved with it
    page.screenshot(path=str(screenshot_dir / "replicas-reload-after-kill.png"), full_page=True)
    assert answered_by(killed_ms) == {moved_to}, answered  # since the kill, every response from the other one
    kept = history_exchanges(web_lb.db_url, sid)
    assert [q for q, _ in kept] == [*QUESTIONS, QUESTIONS[0]]
    assert [(t.user_text, t.reply_text) for t in file_turns(web_lb.db_url, sid, web_lb.sessions_dir)] == kept
