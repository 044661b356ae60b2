"""Shared fixtures: settings on a temporary data directory, the real default model
(loaded once per test session), and tiny random transformers models for fast tests."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from isagi.config import Settings, load_settings

#: the llama-server build started at collection (see pytest_collection_finish)
_ANCHOR_BUILD = pytest.StashKey[subprocess.Popen]()


def pytest_collection_modifyitems(config: pytest.Config, items: list[pytest.Item]) -> None:
    """Tests marked ``anchor`` (they need llama.cpp's llama-server) run last, so that a build
    started in the background at collection has the whole run to finish in."""
    items[:] = [i for i in items if not i.get_closest_marker("anchor")] + [
        i for i in items if i.get_closest_marker("anchor")]


#: the background build: its own session (so its own scheduling autogroup) at nice 19, and
#: SCHED_IDLE: it runs on idle CPU only. Plain ``nice`` 19 is not enough: with autogroups on
#: (Linux's default), nice weighs a process only against its own session's, and the servers the
#: browser tests start run in sessions of their own (they ran up to 3x slower beside a niced build)
_IDLE_BUILD = """
import os, pathlib, sys
try:
    with open("/proc/self/autogroup", "w") as group:
        group.write("19")
except OSError:
    pass
try:
    os.sched_setscheduler(0, os.SCHED_IDLE, os.sched_param(0))
except (AttributeError, OSError):
    os.nice(19)
from isagi.bench.anchor_build import ensure
ensure(pathlib.Path(sys.argv[1]))
"""


def pytest_collection_finish(session: pytest.Session) -> None:
    """With ISAGI_TEST_BUILD_ANCHOR=1 (CI) and a shared ISAGI_TEST_HOME without a cached
    llama-server, when a selected test needs one: build it now, in the background on idle CPU
    (:data:`_IDLE_BUILD`), instead of minutes of the run's own time when its test comes. The
    test waits for it (fixture ``anchor_built_in_background``); a build that failed is tried
    again there, in the foreground, where its error shows."""
    home = os.environ.get("ISAGI_TEST_HOME")
    if (os.environ.get("ISAGI_TEST_BUILD_ANCHOR") != "1" or not home or os.environ.get("ISAGI_TEST_ANCHOR")
            or session.config.option.collectonly
            or not any(i.get_closest_marker("anchor") for i in session.items)):
        return
    from isagi.bench import anchor_build

    if anchor_build.cached_path(Path(home)).is_file():
        return
    Path(home).mkdir(parents=True, exist_ok=True)
    with open(Path(home) / "anchor-build.log", "wb") as log:
        session.config.stash[_ANCHOR_BUILD] = subprocess.Popen(
            [sys.executable, "-c", _IDLE_BUILD, home], stdout=log, stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL, start_new_session=True)


def pytest_sessionfinish(session: pytest.Session) -> None:
    proc = session.config.stash.get(_ANCHOR_BUILD, None)
    if proc is not None and proc.poll() is None:  # its test was not reached: nothing left behind
        os.killpg(proc.pid, signal.SIGKILL)  # the build's whole session: cmake and the compilers too
        proc.wait()


@pytest.fixture
def anchor_built_in_background(request: pytest.FixtureRequest) -> int | None:
    """The exit status of the llama-server build started at collection, once it has ended;
    None when none was started."""
    proc = request.config.stash.get(_ANCHOR_BUILD, None)
    return None if proc is None else proc.wait()


def _shared_home(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """ISAGI_TEST_HOME lets CI and developers reuse one converted model between runs."""
    if env := os.environ.get("ISAGI_TEST_HOME"):
        path = Path(env)
        path.mkdir(parents=True, exist_ok=True)
        return path
    return tmp_path_factory.mktemp("isagi-home")


@pytest.fixture(scope="session")
def settings_default(tmp_path_factory: pytest.TempPathFactory) -> Settings:
    """Settings for the embedded default model in NF4 on the CPU."""
    return load_settings(environ={}, home=_shared_home(tmp_path_factory), device="cpu")


@pytest.fixture(scope="session")
def default_lm(settings_default: Settings):
    """The real SmolLM2-135M-Instruct in NF4 through transformers (a LoadedModel), loaded once."""
    from isagi.engines.hf.model import load_model

    return load_model(settings_default)


@pytest.fixture(scope="session")
def default_hf(default_lm):
    """``default_lm`` behind the engine seam: the transformers + bitsandbytes engine."""
    from isagi.engines.hf.engine import TransformersEngine

    return TransformersEngine(default_lm, backend_reason="tests")


@pytest.fixture(scope="session")
def default_llama(settings_default: Settings):
    """The embedded GGUF as it is, through llama.cpp (what ``auto`` picks on a CPU), loaded once."""
    from isagi.engines import load_engine

    return load_engine(settings_default.with_overrides(backend="llamacpp"))


@pytest.fixture(scope="session", params=["llamacpp", "transformers"])
def default_model(request: pytest.FixtureRequest):
    """The default model behind each backend in turn: tests using it run on both."""
    return request.getfixturevalue("default_llama" if request.param == "llamacpp" else "default_hf")


@pytest.fixture(params=["sqlite", pytest.param("postgres", marks=pytest.mark.postgres)])
def db_url(request: pytest.FixtureRequest, tmp_path: Path):
    """A blank history database: a SQLite file (in a directory that does not exist yet)
    or a fresh schema on the PostgreSQL server named by ISAGI_TEST_POSTGRES_URL."""
    if request.param == "sqlite":
        yield f"sqlite:///{tmp_path / 'new-dir' / 'history.db'}"
        return
    yield from _fresh_pg_schema()


def _fresh_pg_schema():
    """The URL of a fresh schema on the PostgreSQL server named by ISAGI_TEST_POSTGRES_URL,
    dropped afterwards (the test is skipped without that server)."""
    from tests import history_db

    if not history_db.PG_URL:
        pytest.skip("ISAGI_TEST_POSTGRES_URL is not set")
    schema, url = history_db.fresh_pg_schema()
    try:
        yield url
    finally:
        history_db.drop_pg_schema(schema)


@pytest.fixture
def pg_url():
    """A blank PostgreSQL schema (the shared session store's tests)."""
    yield from _fresh_pg_schema()


@pytest.fixture
def store(db_url: str):
    """A HistoryStore on ``db_url``, closed after the test."""
    from isagi.storage.history import HistoryStore

    s = HistoryStore(db_url)
    try:
        yield s
    finally:
        s.close()


def tiny_model(kind: str = "llama", seed: int = 0, context: int = 256):
    """A tiny random decoder model of the given family, built from a config (no download)."""
    import torch
    from transformers import AutoModelForCausalLM, LlamaConfig, Qwen2Config

    torch.manual_seed(seed)
    common = dict(
        hidden_size=64,
        intermediate_size=128,
        num_hidden_layers=4,
        num_attention_heads=4,
        num_key_value_heads=2,
        vocab_size=256,
        max_position_embeddings=context,
    )
    config = LlamaConfig(**common) if kind == "llama" else Qwen2Config(**common)
    return AutoModelForCausalLM.from_config(config).eval()


def _engine_on(lm, settings_default: Settings, home: Path):
    """An Engine on ``lm`` with its profile (the shipped one for the default model) and a
    history store under ``home``."""
    from isagi.pipeline.engine import Engine
    from isagi.profile import load_or_build_profile

    profile = load_or_build_profile(lm, settings_default)
    return Engine.start(settings_default.with_overrides(home=home), lm=lm, profile=profile)


@pytest.fixture(scope="session")
def default_engine(settings_default: Settings, default_model, tmp_path_factory: pytest.TempPathFactory):
    """An Engine on the real default model and its profile (each backend in turn), with a
    history store in a temp dir."""
    return _engine_on(default_model, settings_default, tmp_path_factory.mktemp("engine-home"))


@pytest.fixture(scope="session")
def llama_engine(settings_default: Settings, default_llama, tmp_path_factory: pytest.TempPathFactory):
    """An Engine on the real default model through llama.cpp only, for model tests whose
    subject does not depend on the backend and that would take too long in NF4."""
    return _engine_on(default_llama, settings_default, tmp_path_factory.mktemp("llama-engine-home"))
