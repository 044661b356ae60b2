"""Settings: one reader of the ISAGI_* environment; flags override it."""

from __future__ import annotations

from pathlib import Path

import pytest

from isagi.config import load_settings
from isagi.errors import ConfigError


def test_environment_is_read_and_flags_override(tmp_path: Path) -> None:
    env = {"ISAGI_HOME": str(tmp_path), "ISAGI_QUANT": "NONE", "ISAGI_LAYER": "12", "ISAGI_K": "32",
           "ISAGI_DATABASE_URL": "postgresql+psycopg://u:p@127.0.0.1/db"}
    s = load_settings(env)
    assert (s.home, s.quant, s.layer, s.k) == (tmp_path, "none", 12, 32)
    assert s.resolved_database_url.startswith("postgresql")
    s2 = load_settings(env, quant="nf4", layer=None)
    assert s2.quant == "nf4" and s2.layer == 12  # None means "no flag given"


def test_upload_quota_is_read_in_mib(tmp_path: Path) -> None:
    assert load_settings({"ISAGI_HOME": str(tmp_path)}).upload_quota_mb == 128
    assert load_settings({"ISAGI_UPLOAD_QUOTA_MB": "300"}).upload_quota_mb == 300


def test_default_database_is_sqlite_in_home(tmp_path: Path) -> None:
    s = load_settings({"ISAGI_HOME": str(tmp_path)})
    assert s.resolved_database_url == f"sqlite:///{tmp_path / 'history.sqlite3'}"


@pytest.mark.parametrize("env, match", [
    ({"ISAGI_QUANT": "int3"}, "nf4, none"),
    ({"ISAGI_K": "sixty"}, "whole number"),
    ({"ISAGI_LAYER": "0"}, "layer"),
    ({"ISAGI_DEVICE": "tpu"}, "auto"),
    ({"ISAGI_CONTEXT_SHIFT": "maybe"}, "1 \\(on\\) or 0 \\(off\\)"),
    ({"ISAGI_UPLOAD_QUOTA_MB": "0"}, "ISAGI_UPLOAD_QUOTA_MB=0: use a number of MiB"),
    ({"ISAGI_UPLOAD_QUOTA_MB": "lots"}, "whole number"),
])
def test_bad_settings_say_what_to_do(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_settings(env)


def test_trusted_proxies_are_addresses_or_networks_written_canonically(tmp_path: Path) -> None:
    s = load_settings({"ISAGI_TRUSTED_PROXIES": " 127.0.0.1, 10.1.2.3/8,::1, 127.0.0.1"})
    assert s.trusted_proxies == ("127.0.0.1", "10.0.0.0/8", "::1")  # uvicorn reads 10.1.2.3/8 as no network
    assert load_settings({}).trusted_proxies == ()
    assert load_settings({}, trusted_proxies="192.168.0.1").trusted_proxies == ("192.168.0.1",)  # the flag
    for bad in ("proxy.example", "1.2.3.4/99", "*"):
        with pytest.raises(ConfigError, match="ISAGI_TRUSTED_PROXIES"):
            load_settings({"ISAGI_TRUSTED_PROXIES": bad})
@pytest.mark.parametrize("value, on", [("0", False), ("off", False), ("1", True), ("TRUE", True)])
def test_the_context_shift_is_a_switch(value: str, on: bool) -> None:
    assert load_settings({}).context_shift is True
    assert load_settings({"ISAGI_CONTEXT_SHIFT": value}).context_shift is on


@pytest.mark.parametrize("variable, field", [("ISAGI_ADAPT_THREADS", "adapt_threads"),
                                             ("ISAGI_READ_IN_CONVERSATION", "read_in_conversation")])
@pytest.mark.parametrize("value, on", [("0", False), ("no", False), ("off", False), ("1", True)])
def test_switches_on_by_default(variable: str, field: str, value: str, on: bool) -> None:
    """Adapting the thread count, reading a message in its conversation first."""
    assert getattr(load_settings({}), field) is True
    assert getattr(load_settings({variable: value}), field) is on
    with pytest.raises(ConfigError, match=variable):
        load_settings({variable: "sometimes"})
