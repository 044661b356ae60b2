"""Named page updates: a handler's update becomes the tuple of its event's outputs by name,
leaves every other component as it is, and cannot draw into a component its event lacks."""

from __future__ import annotations

from dataclasses import fields

import gradio as gr
import pytest

from isagi.app import updates as u
from isagi.app.updates import KEEP, PageUpdate

OUTPUT_LISTS = {name: v for name, v in vars(u).items() if name.isupper() and isinstance(v, tuple)}


def test_out_orders_by_the_events_outputs_and_skips_what_is_kept():
    update = PageUpdate(alert="careful", state="s1")
    out = update.out(u.NEW_CHAT)
    assert out[:2] == ("s1", "careful")
    skip = gr.skip()
    assert all(type(x) is type(skip) and x == skip for x in out[2:]), "the view is left as it is"
    assert PageUpdate().out(u.STOP) == tuple(gr.skip() for _ in u.STOP)


def test_an_update_setting_a_component_its_event_lacks_fails_loudly():
    with pytest.raises(ValueError, match="table"):
        PageUpdate(state="s1", table=[]).out(u.NEW_CHAT)


def test_but_and_changed_name_what_an_update_sets():
    view = PageUpdate(chat=[], turn="t")
    both = view.but(state="s2")
    assert both.changed() == {"chat": [], "turn": "t", "state": "s2"} and view.state is KEEP


def test_every_output_list_names_components_of_the_page_once():
    names = {f.name for f in fields(PageUpdate)}
    assert {"VIEW", "TURN", "LOAD", "UPLOAD", "RESUME", "EXPLORE"} <= set(OUTPUT_LISTS)
    for list_name, outputs in OUTPUT_LISTS.items():
        assert set(outputs) <= names, list_name
        assert len(set(outputs)) == len(outputs), f"{list_name} names a component twice"
    assert set().union(*OUTPUT_LISTS.values()) == names, "every component of an update is some event's output"


def test_an_event_with_one_output_gets_the_bare_value_not_a_one_item_tuple():
    """Gradio takes whatever a one-output handler returns as that output's value: a 1-tuple
    would be stored as the browser's session id (a reload then reopened nothing)."""
    assert PageUpdate(stored="s1").value(u.STORED) == "s1"
    assert PageUpdate(chosen="abc").value(u.SELECT) == "abc"
    assert PageUpdate(table=[], sessions_note="n").value(u.LIST) == ([], "n")
