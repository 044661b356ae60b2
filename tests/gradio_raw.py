"""Gradio's HTTP protocol as a logged-in attacker uses it: log in, read the page's
config, and call any event by ``fn_index`` (queued or direct), with any data and
any Gradio session hash. Shared by the fast two-user test (FastAPI's test
client) and the live one (httpx against a real server)."""

from __future__ import annotations

import json
from typing import Any


class RawGradio:
    """What an attacker with a login has: HTTP calls to the queue and the API by ``fn_index``."""

    def __init__(self, http: Any, user: str | None, password: str = "") -> None:
        """``http``: an httpx-compatible client on the app's root (its own cookies);
        ``user=None``: an app without a login."""
        self.http = http
        if user is not None:
            r = self.http.post("login", data={"username": user, "password": password})
            assert r.status_code == 200, r.text
        self.config = self.http.get("config").json()
        self.components = {c["id"]: c for c in self.config["components"]}

    def deps(self) -> list[dict[str, Any]]:
        return list(self.config["dependencies"])

    def call(self, dep: dict[str, Any], data: list[Any], session_hash: str) -> dict[str, Any]:
        """Run one event as the page would (queue, or direct when it is not queued);
        returns {"success": bool, "output": ...} or {"refused": status}."""
        body = {"data": data, "fn_index": dep["id"], "session_hash": session_hash,
                "event_data": None, "trigger_id": None}
        if not dep.get("queue", True):
            r = self.http.post("gradio_api/run/predict", json=body)
            return {"success": r.status_code == 200, "output": r.json() if r.content else None,
                    "status": r.status_code}
        r = self.http.post("gradio_api/queue/join", json=body)
        if r.status_code != 200:
            return {"refused": r.status_code, "output": r.text}
        event_id = r.json()["event_id"]
        with self.http.stream("GET", "gradio_api/queue/data", params={"session_hash": session_hash}) as s:
            for line in s.iter_lines():
                if not line.startswith("data:"):
                    continue
                msg = json.loads(line[5:])
                if msg.get("event_id") == event_id and msg.get("msg") == "process_completed":
                    return {"success": bool(msg.get("success")), "output": msg.get("output")}
        raise AssertionError(f"no completion for fn_index {dep['id']}")

    def value_for(self, comp_id: int, alice_id: str, file_path: str | None = None) -> Any:
        """An input value: alice's session id in every text or state slot, a file object naming
        ``file_path`` (a path on the server) in every file slot, a harmless default elsewhere."""
        c = self.components[comp_id]
        kind = c.get("type") or c.get("props", {}).get("name")
        props = c.get("props", {})
        if kind in ("textbox", "state", "browserstate"):
            return alice_id
        if kind == "file" and file_path:
            return {"path": file_path, "orig_name": "x.miku", "meta": {"_type": "gradio.FileData"}}
        if kind == "slider":
            return props.get("minimum", 8)
        if kind == "checkbox":
            return False
        if kind == "radio":
            return "tier"
        if kind == "dataframe":
            return {"headers": ["id", "title", "turns", "updated (UTC)", "state"],
                    "data": [[alice_id, "x", 1, "2026-01-01 00:00", "saved"]]}
        return None


def component_id(raw: RawGradio, elem_id: str) -> int:
    return next(cid for cid, c in raw.components.items() if c.get("props", {}).get("elem_id") == elem_id)
