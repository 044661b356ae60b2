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
    ({"ISAGI_UPLOAD_QUOTA_MB": "0"}, "ISAGI_UPLOAD_QUOTA_MB=0: use a number of MiB"),
    ({"ISAGI_UPLOAD_QUOTA_MB": "lots"}, "whole number"),
])
def test_bad_settings_say_what_to_do(env: dict[str, str], match: str) -> None:
    with pytest.raises(ConfigError, match=match):
        load_settings(env)
