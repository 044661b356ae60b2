"""What a call of one of the page's events may carry, checked before Gradio reads it.

Owns :class:`EventShapes`: from the built page (its Blocks config) the inputs of every event,
by number (``fn_index``) and by API name, each with its component's kind and range, and the
check of a call's ``data`` against them. Gradio hands whatever arrives to its components'
``preprocess`` and to the handler: a missing value, a string where a slider sends a number, a
slider value past its end or a choice the radio does not offer raised inside Gradio, gave a
500 and wrote a traceback of 20 to 90 lines per request (issue 37). The guard
(:class:`app.guard.GradioGuard`) asks :meth:`EventShapes.problem` first and answers a 400 with
one line instead, logging nothing.

The routes and their bodies (Gradio 6): ``queue/join`` ``{"fn_index", "data": [...]}``, one
value per input, states included (sent as null); ``run/<api>``, ``api/<api>`` and
``call/<api>`` ``{"data": [...]}``, every input or only those of the API (without states);
``call/v2/<api>`` the inputs by parameter name.
"""

from __future__ import annotations

import contextlib
import math
from dataclasses import dataclass
from typing import Any

# Components whose value the browser does not send (Gradio keeps it on the server).
STATE_KINDS = frozenset({"state", "browserstate"})


@dataclass(frozen=True)
class Input:
    """One input of an event: its parameter name, component kind and the props that bound it."""

    name: str
    kind: str
    minimum: float | None = None
    maximum: float | None = None
    choices: tuple[Any, ...] | None = None

    def problem(self, value: Any) -> str | None:
        """Why ``value`` cannot be this input's (None: it can)."""
        kind = self.kind
        if kind in STATE_KINDS:
            return None
        if kind in ("slider", "number"):
            if isinstance(value, bool) or not isinstance(value, int | float) or not math.isfinite(value):
                return f"{self.name} must be a number"
            if (self.minimum is not None and value < self.minimum) or (self.maximum is not None and value > self.maximum):
                return f"{self.name} must be from {self.minimum:g} to {self.maximum:g}"
            return None
        if kind == "checkbox":
            return None if isinstance(value, bool) else f"{self.name} must be true or false"
        if kind == "textbox":
            return None if value is None or isinstance(value, str) else f"{self.name} must be text"
        if kind in ("radio", "dropdown") and self.choices is not None:
            return None if value in self.choices else f"{self.name} must be one of the offered choices"
        if kind in ("radio", "dropdown"):  # choices set per page (the chat list): an id, checked by its handler
            return None if value is None or isinstance(value, str) else f"{self.name} must be text"
        if kind in ("file", "uploadbutton"):
            return None if value is None or isinstance(value, dict) else f"{self.name} must be a file"
        return None


@dataclass(frozen=True)
class Event:
    """One event of the page: its number, API name and inputs in order."""

    index: int
    api_name: str | None
    inputs: tuple[Input, ...]

    @property
    def api_inputs(self) -> tuple[Input, ...]:
        return tuple(i for i in self.inputs if i.kind not in STATE_KINDS)

    def problem(self, data: Any, *, api_only_allowed: bool) -> str | None:
        """Why ``data`` (a call's list of values) cannot be this event's inputs (None: it can)."""
        if not isinstance(data, list):
            return "data must be a list with one value per input"
        if len(data) == len(self.inputs):
            pairs = zip(self.inputs, data, strict=True)
        elif api_only_allowed and len(data) == len(self.api_inputs):
            pairs = zip(self.api_inputs, data, strict=True)
        else:
            return f"this event takes {len(self.api_inputs)} values, not {len(data)}"
        for spec, value in pairs:
            if (why := spec.problem(value)) is not None:
                return why
        return None

    def named_problem(self, body: dict[str, Any]) -> str | None:
        """Why a call by parameter name (``call/v2``) cannot be this event's (None: it can)."""
        by_name = {i.name: i for i in self.api_inputs}
        unknown = [k for k in body if k not in by_name and k != "oauth_token"]
        if unknown:
            return f"unknown parameter {str(unknown[0])[:40]!r}"
        missing = [n for n in by_name if n not in body]
        if missing:
            return f"missing parameter {missing[0]!r}"
        for name, spec in by_name.items():
            if (why := spec.problem(body[name])) is not None:
                return why
        return None


class EventShapes:
    """The page's events by number and by API name (:func:`from_blocks`), and the check of a call."""

    def __init__(self, events: list[Event]) -> None:
        self.by_index = {e.index: e for e in events}
        self.by_name = {e.api_name: e for e in events if e.api_name}

    @classmethod
    def from_blocks(cls, blocks: Any) -> EventShapes:
        """Read the events of a built ``gr.Blocks`` from its config (and its handlers' parameter names)."""
        config = blocks.config
        components = {c["id"]: c for c in config["components"]}
        events = []
        for dep in config["dependencies"]:
            names = _parameter_names(blocks, dep["id"], len(dep["inputs"]))
            inputs = []
            for name, cid in zip(names, dep["inputs"], strict=True):
                comp = components.get(cid, {})
                props = comp.get("props", {})
                choices = props.get("choices")
                inputs.append(Input(
                    name=name, kind=str(comp.get("type", "")),
                    minimum=props.get("minimum"), maximum=props.get("maximum"),
                    choices=tuple(c[1] if isinstance(c, list | tuple) else c for c in choices)
                    if isinstance(choices, list) and choices else None,  # none at build: set per page
                ))
            events.append(Event(int(dep["id"]), dep.get("api_name") or None, tuple(inputs)))
        return cls(events)

    def problem(self, route: str, body: Any) -> str | None:
        """Why the JSON ``body`` of a POST to ``route`` (the path after ``/gradio_api/``) cannot
        be a call of one of the page's events; None when it can or the route runs no event."""
        parts = route.split("/")
        if route == "queue/join":
            if not isinstance(body, dict):
                return "the body must be a JSON object"
            index = body.get("fn_index")
            event = self.by_index.get(index) if isinstance(index, int) and not isinstance(index, bool) else None
            if event is None:
                return "fn_index names no event of this page"
            return event.problem(body.get("data"), api_only_allowed=False)
        if len(parts) == 3 and parts[0] == "call" and parts[1] == "v2":
            event = self.by_name.get(parts[2])
            if event is None:
                return None  # Gradio answers an unknown name with its own 404
            return event.named_problem(body) if isinstance(body, dict) else "the body must be a JSON object"
        if len(parts) == 2 and parts[0] in ("run", "api", "call"):
            event = self.by_name.get(parts[1])
            if event is None:
                return None
            if not isinstance(body, dict):
                return "the body must be a JSON object"
            return event.problem(body.get("data"), api_only_allowed=True)
        return None


def _parameter_names(blocks: Any, index: int, n: int) -> list[str]:
    """The parameter names of event ``index``'s handler (``call/v2`` names its values by them),
    or ``input_<k>`` where the handler does not say."""
    import inspect

    fn = blocks.fns[index].fn if index in blocks.fns else None
    params: list[str] = []
    if fn is not None:
        with contextlib.suppress(TypeError, ValueError):
            params = [p.name for p in inspect.signature(fn).parameters.values()
                      if p.kind in (p.POSITIONAL_ONLY, p.POSITIONAL_OR_KEYWORD) and p.name != "request"]
    return params[:n] if len(params) >= n else [f"input_{k}" for k in range(n)]
