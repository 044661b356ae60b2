"""Settings: the one place that reads the ``ISAGI_*`` environment.

Every other module receives a :class:`Settings` object; command-line flags
override settings through :meth:`Settings.with_overrides`.
"""

from __future__ import annotations

import ipaddress
import os
import re
from dataclasses import dataclass, field, fields, replace
from pathlib import Path
from typing import Any

from isagi.errors import ConfigError

DEFAULT_SYSTEM_PROMPT = (
    "You are ISAGI, a helpful, honest and concise assistant. "
    "Answer clearly and briefly."
)
QUANT_CHOICES = ("nf4", "none")
DEVICE_CHOICES = ("auto", "cpu", "cuda")
BACKEND_CHOICES = ("auto", "llamacpp", "transformers")
# The servers' sequence slots unless ISAGI_PARALLEL says otherwise: on the project's 2-core
# machine kind, 16 users were answered soonest with one of 1, 2, 4 or 8, and 8 users with one
# rather than 8 (docs/measurements.md, "Every
# decode on one thread, and how many slots"): a turn's prompts, about half its model time,
# gain nothing from batching, and the turns' own Python work takes cores from the batch.
# A machine with more cores may gain from more (measure with isagi bench web).
SERVER_PARALLEL = 1
MAX_PARALLEL = 64


@dataclass(frozen=True)
class Settings:
    """Everything ISAGI can be told through its environment.

    Attributes mirror the ``ISAGI_*`` variables (the settings table of README.md).
    """

    home: Path = field(default_factory=lambda: Path.home() / ".isagi")
    model: str = "default"
    quant: str = "nf4"
    device: str = "auto"
    backend: str = "auto"  # auto | llamacpp | transformers (isagi.engines.choose_backend)
    threads: int | None = None  # llama.cpp threads; None: every core (os.cpu_count())
    # llama.cpp: run on one thread while decodes on ``threads`` run much slower than usual (another
    # program holds a core), trying ``threads`` again now and then (isagi.engines.llamacpp.threads)
    adapt_threads: bool = True
    # llama.cpp: replies decoded at once, each in a sequence slot of one context (their
    # single-token steps share one llama_decode; isagi.engines.llamacpp_steps). Each slot
    # holds a whole context's KV cache (isagi info states what they cost). None: the command's
    # default, SERVER_PARALLEL for the servers (isagi web, serve), 1 for everything else.
    parallel: int | None = None
    database_url: str | None = None
    # Where the .miku session files live: None, the sessions directory under ``home``; a
    # postgresql URL, a table there every replica shares, each live session leased to one
    # process (isagi.session.store, isagi.session.lease).
    sessions_url: str | None = None
    layer: int | None = None  # None: the model's default (2/3 of its depth)
    safety_layer: int | None = None  # None: the model's default for safety (3/5 of its depth)
    k: int = 64
    system_prompt: str = DEFAULT_SYSTEM_PROMPT
    max_new_tokens: int = 256
    max_message_chars: int = 8000
    # A message's limit in tokens as well as characters: 8,000 emoji are ~24,000
    # tokens, three times SmolLM2's context, and one such prefill stalls every user.
    max_message_tokens: int = 1024
    # Token budget of a whole prompt (system prompt, kept history, related exchange,
    # message). Prefill cost grows with the prompt: on a 2-core CPU an 8,105-token
    # prompt took 27 s per turn, ~2,000 tokens keep a turn to a few seconds. Capped
    # at the model's context minus max_new_tokens (isagi.pipeline.prompts.Prompts.budget).
    prompt_token_budget: int = 2048
    # llama.cpp: when the history window drops old exchanges, reuse the previous turn's KV cache
    # with them cut out (a context shift) instead of evaluating the kept history again.
    context_shift: bool = True
    # A message after some history is read in its conversation first, by the reply's own prefill:
    # the message read alone (a second prefill) only when that reading is not clearly safe
    # (isagi.pipeline.engine, Engine._prepare; docs/measurements.md, "Reading the message in its
    # conversation first").
    read_in_conversation: bool = True
    auth: str | None = None  # "user:pass,user2:pass2" for the web app
    # "user:KEY,user2:KEY2": Bearer keys of the OpenAI-compatible API (app/api.py), each
    # working as that owner (the same names as ``auth``)
    api_keys: str | None = None
    # Live sessions the web app keeps at once: per client (each client address,
    # and each logged-in user) and overall. A session is made only for a valid
    # message or an opened file; at a cap the oldest empty ones are reclaimed
    # first, then a new one is refused with a message.
    max_sessions_per_client: int = 32
    max_sessions: int = 256
    # Login throttling: after this many failed logins in a row for a user name
    # (or from a client address), further attempts are refused for
    # login_backoff_s seconds, doubled at each further failure (up to an hour).
    login_max_failures: int = 5
    login_backoff_s: float = 30.0
    # Reverse proxies (or tunnels) whose X-Forwarded-For the web app believes, as
    # IP addresses or networks. Empty: no forwarded header is believed, and a
    # client's address is the address that connected (the per-address caps and
    # the login back-off key on it).
    trusted_proxies: tuple[str, ...] = ()
    # Disk one user's web uploads may take while they wait to be opened (and while
    # they arrive), in MiB: a new upload first removes that user's oldest waiting
    # ones, and is refused when those still arriving leave no room. At least one
    # largest .miku (64 MiB) plus its request's few bytes of framing.
    upload_quota_mb: int = 128
    # Sessions (their .miku files and history rows) untouched for longer than this many days are
    # removed, at the server's start and daily after (isagi.session.retention); None: kept for good.
    session_retention_days: float | None = None
    # A web session unused this long is saved and dropped from memory (resumed from its file).
    web_idle_minutes: float = 30.0
    # Behind a balancer (docs/architecture.md, "Several replicas"): this process's name, sent in
    # every response's X-Isagi-Replica header (None: no header), and how long SIGTERM lets the
    # turns in flight finish (/health says draining meanwhile) before the server stops anyway.
    replica: str | None = None
    drain_s: float = 30.0

    def with_overrides(self, **overrides: object) -> Settings:
        """A copy with every override that is not ``None`` applied and checked."""
        clean: dict[str, Any] = {k: v for k, v in overrides.items() if v is not None}  # checked by _validated
        if "home" in clean:
            clean["home"] = Path(str(clean["home"])).expanduser()
        if isinstance(clean.get("trusted_proxies"), str):  # a flag's text, as the variable's
            clean["trusted_proxies"] = parse_proxies(str(clean["trusted_proxies"]))
        return _validated(replace(self, **clean))

    @property
    def slots(self) -> int:
        """The model's sequence slots: ``parallel``, or 1 when it is left to the command."""
        return self.parallel or 1

    def for_server(self) -> Settings:
        """These settings as a server runs them: ``parallel`` left open becomes :data:`SERVER_PARALLEL`."""
        return self if self.parallel is not None else replace(self, parallel=SERVER_PARALLEL)

    # Derived locations under the data directory.
    @property
    def models_dir(self) -> Path:
        return self.home / "models"

    @property
    def profiles_dir(self) -> Path:
        return self.home / "profiles"

    @property
    def sessions_dir(self) -> Path:
        return self.home / "sessions"

    @property
    def resolved_database_url(self) -> str:
        return self.database_url or f"sqlite:///{self.home / 'history.sqlite3'}"


def _int(name: str, value: str) -> int:
    try:
        return int(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a whole number; set it to e.g. 20.") from None


def _validated(s: Settings) -> Settings:
    if s.quant not in QUANT_CHOICES:
        raise ConfigError(f"quantisation {s.quant!r} is unknown; use one of {', '.join(QUANT_CHOICES)}.")
    if s.device not in DEVICE_CHOICES:
        raise ConfigError(f"device {s.device!r} is unknown; use one of {', '.join(DEVICE_CHOICES)}.")
    if s.backend not in BACKEND_CHOICES:
        raise ConfigError(f"backend {s.backend!r} is unknown; use one of {', '.join(BACKEND_CHOICES)} (ISAGI_BACKEND or --backend).")
    if s.threads is not None and s.threads < 1:
        raise ConfigError(f"threads={s.threads}: use at least 1 (ISAGI_THREADS).")
    if s.parallel is not None and not (1 <= s.parallel <= MAX_PARALLEL):
        raise ConfigError(f"parallel={s.parallel}: use 1 to {MAX_PARALLEL} sequence slots (ISAGI_PARALLEL or --parallel).")
    if s.k < 2:
        raise ConfigError(f"k={s.k} is too small; the UGT basis needs at least 2 dimensions.")
    if s.layer is not None and s.layer < 1:
        raise ConfigError(f"layer={s.layer}: use a decoder layer index >= 1 (0 is the embeddings).")
    if s.safety_layer is not None and s.safety_layer < 1:
        raise ConfigError(f"safety_layer={s.safety_layer}: use a decoder layer index >= 1 (0 is the embeddings).")
    if s.max_new_tokens < 1:
        raise ConfigError("max_new_tokens must be at least 1.")
    if s.max_message_tokens < 1:
        raise ConfigError("max_message_tokens must be at least 1 (ISAGI_MAX_MESSAGE_TOKENS).")
    if s.prompt_token_budget < s.max_message_tokens:
        raise ConfigError(
            f"prompt_token_budget={s.prompt_token_budget} is below max_message_tokens={s.max_message_tokens}; "
            "set ISAGI_PROMPT_TOKENS at least as large as ISAGI_MAX_MESSAGE_TOKENS."
        )
    if s.max_sessions_per_client < 1 or s.max_sessions < 1:
        raise ConfigError(
            "ISAGI_MAX_SESSIONS_PER_CLIENT and ISAGI_MAX_SESSIONS must be at least 1 "
            f"(got {s.max_sessions_per_client} and {s.max_sessions})."
        )
    if s.login_max_failures < 1:
        raise ConfigError(f"ISAGI_LOGIN_FAILURES={s.login_max_failures}: allow at least 1 failed login.")
    if not (0 < s.login_backoff_s <= 86_400):
        raise ConfigError(f"ISAGI_LOGIN_BACKOFF_S={s.login_backoff_s}: use a number of seconds from 0 to 86400.")
    if s.trusted_proxies:
        s = replace(s, trusted_proxies=tuple(dict.fromkeys(_proxy(e) for e in s.trusted_proxies)))
    if not (1 <= s.upload_quota_mb <= 1_048_576):
        raise ConfigError(
            f"ISAGI_UPLOAD_QUOTA_MB={s.upload_quota_mb}: use a number of MiB from 1 to 1048576 "
            "(65 or more lets a user upload the largest .miku, 64 MiB)."
        )
    if not (0 < s.web_idle_minutes <= 10_080):
        raise ConfigError(f"ISAGI_IDLE_MINUTES={s.web_idle_minutes:g}: use a number of minutes from 0 to 10080 (a week).")
    if s.session_retention_days is not None and not (0 < s.session_retention_days <= 36_500):
        raise ConfigError(f"ISAGI_SESSION_RETENTION={s.session_retention_days:g}: use a number of days from "
                          "above 0 up to 36500 (e.g. 30), or leave it unset to keep every session.")
    if s.sessions_url is not None:
        _check_sessions_url(s.sessions_url)
    if s.replica is not None and not _REPLICA_NAME.fullmatch(s.replica):
        raise ConfigError(f"ISAGI_REPLICA={s.replica[:70]!r}: use 1 to 64 letters, digits, dots, dashes or "
                          "underscores (it is sent in a response header), e.g. ISAGI_REPLICA=isagi-1.")
    if not (0 <= s.drain_s <= 3600):
        raise ConfigError(f"ISAGI_DRAIN_S={s.drain_s:g}: use a number of seconds from 0 to 3600 (e.g. 30).")
    return s


_REPLICA_NAME = re.compile(r"[A-Za-z0-9._-]{1,64}")


def _check_sessions_url(url: str) -> None:
    if not url.startswith(("postgresql:", "postgresql+", "postgres:")):
        raise ConfigError(
            f"ISAGI_SESSIONS_URL={url[:60]!r}: use a PostgreSQL URL such as "
            "postgresql+psycopg://user:pw@host/db (shared by every replica), or leave it unset "
            "for the sessions directory under ISAGI_HOME."
        )


def _proxy(entry: str) -> str:
    """One ISAGI_TRUSTED_PROXIES entry, checked and written canonically: an IP address
    (``127.0.0.1``) or a network (``10.0.0.0/8``; host bits are cleared)."""
    entry = str(entry).strip()
    if entry == "*":
        raise ConfigError(
            "ISAGI_TRUSTED_PROXIES=*: trusting every address lets any client choose the address "
            "the app sees; name the proxy's own address, e.g. ISAGI_TRUSTED_PROXIES=127.0.0.1."
        )
    try:
        if "/" in entry:
            return str(ipaddress.ip_network(entry, strict=False))
        return str(ipaddress.ip_address(entry))
    except ValueError:
        raise ConfigError(
            f"ISAGI_TRUSTED_PROXIES entry {entry[:60]!r} is not an IP address or network; "
            "write e.g. 127.0.0.1,10.0.0.0/8 (or --trusted-proxies 127.0.0.1)."
        ) from None


def parse_proxies(spec: str) -> tuple[str, ...]:
    """``"127.0.0.1, 10.0.0.0/8"`` -> ``("127.0.0.1", "10.0.0.0/8")``; empty entries are dropped."""
    return tuple(item.strip() for item in spec.split(",") if item.strip())


def _switch(name: str, value: str) -> bool:
    v = value.strip().lower()
    if v in ("1", "true", "yes", "on"):
        return True
    if v in ("0", "false", "no", "off"):
        return False
    raise ConfigError(f"{name}={value!r} is not a switch; set it to 1 (on) or 0 (off).")


_PLAIN_NUMBER = re.compile(r"[+-]?(?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:[eE][+-]?[0-9]+)?")


def _float(name: str, value: str) -> float:
    # a plain decimal number only: Python's float() also takes "1_0", Arabic digits and "infinity"
    if not _PLAIN_NUMBER.fullmatch(value.strip()):
        raise ConfigError(f"{name}={value!r} is not a number; set it to e.g. 30.")
    try:
        f = float(value)
    except ValueError:
        raise ConfigError(f"{name}={value!r} is not a number; set it to e.g. 30.") from None
    if f != f or f in (float("inf"), float("-inf")):
        raise ConfigError(f"{name}={value!r} is not a finite number; set it to e.g. 30.")
    return f


def load_settings(environ: dict[str, str] | None = None, **overrides: object) -> Settings:
    """Read ``ISAGI_*`` from ``environ`` (default: ``os.environ``), then apply overrides."""
    env = os.environ if environ is None else environ
    values: dict[str, object] = {}
    if v := env.get("ISAGI_HOME"):
        values["home"] = Path(v).expanduser()
    if v := env.get("ISAGI_MODEL"):
        values["model"] = v
    if v := env.get("ISAGI_QUANT"):
        values["quant"] = v.lower()
    if v := env.get("ISAGI_DEVICE"):
        values["device"] = v.lower()
    if v := env.get("ISAGI_BACKEND"):
        values["backend"] = v.lower()
    if v := env.get("ISAGI_THREADS"):
        values["threads"] = _int("ISAGI_THREADS", v)
    if v := env.get("ISAGI_ADAPT_THREADS"):
        values["adapt_threads"] = _switch("ISAGI_ADAPT_THREADS", v)
    if v := env.get("ISAGI_PARALLEL"):
        values["parallel"] = _int("ISAGI_PARALLEL", v)
    if v := env.get("ISAGI_DATABASE_URL"):
        values["database_url"] = v
    if v := env.get("ISAGI_SESSIONS_URL"):
        values["sessions_url"] = v
    if v := env.get("ISAGI_LAYER"):
        values["layer"] = _int("ISAGI_LAYER", v)
    if v := env.get("ISAGI_SAFETY_LAYER"):
        values["safety_layer"] = _int("ISAGI_SAFETY_LAYER", v)
    if v := env.get("ISAGI_K"):
        values["k"] = _int("ISAGI_K", v)
    if v := env.get("ISAGI_SYSTEM_PROMPT"):
        values["system_prompt"] = v
    if v := env.get("ISAGI_MAX_NEW_TOKENS"):
        values["max_new_tokens"] = _int("ISAGI_MAX_NEW_TOKENS", v)
    if v := env.get("ISAGI_MAX_MESSAGE_TOKENS"):
        values["max_message_tokens"] = _int("ISAGI_MAX_MESSAGE_TOKENS", v)
    if v := env.get("ISAGI_PROMPT_TOKENS"):
        values["prompt_token_budget"] = _int("ISAGI_PROMPT_TOKENS", v)
    if v := env.get("ISAGI_CONTEXT_SHIFT"):
        values["context_shift"] = _switch("ISAGI_CONTEXT_SHIFT", v)
    if v := env.get("ISAGI_READ_IN_CONVERSATION"):
        values["read_in_conversation"] = _switch("ISAGI_READ_IN_CONVERSATION", v)
    if v := env.get("ISAGI_AUTH"):
        values["auth"] = v
    if v := env.get("ISAGI_API_KEYS"):
        values["api_keys"] = v
    if v := env.get("ISAGI_MAX_SESSIONS_PER_CLIENT"):
        values["max_sessions_per_client"] = _int("ISAGI_MAX_SESSIONS_PER_CLIENT", v)
    if v := env.get("ISAGI_MAX_SESSIONS"):
        values["max_sessions"] = _int("ISAGI_MAX_SESSIONS", v)
    if v := env.get("ISAGI_LOGIN_FAILURES"):
        values["login_max_failures"] = _int("ISAGI_LOGIN_FAILURES", v)
    if v := env.get("ISAGI_LOGIN_BACKOFF_S"):
        values["login_backoff_s"] = _float("ISAGI_LOGIN_BACKOFF_S", v)
    if v := env.get("ISAGI_TRUSTED_PROXIES"):
        values["trusted_proxies"] = parse_proxies(v)
    if v := env.get("ISAGI_UPLOAD_QUOTA_MB"):
        values["upload_quota_mb"] = _int("ISAGI_UPLOAD_QUOTA_MB", v)
    if v := env.get("ISAGI_IDLE_MINUTES"):
        values["web_idle_minutes"] = _float("ISAGI_IDLE_MINUTES", v)
    if (v := env.get("ISAGI_SESSION_RETENTION")) and v.strip().lower() != "keep":
        values["session_retention_days"] = _float("ISAGI_SESSION_RETENTION", v)
    if v := env.get("ISAGI_REPLICA"):
        values["replica"] = v.strip()
    if v := env.get("ISAGI_DRAIN_S"):
        values["drain_s"] = _float("ISAGI_DRAIN_S", v)
    known = {f.name for f in fields(Settings)}
    assert set(values) <= known
    return Settings().with_overrides(**values).with_overrides(**overrides)
