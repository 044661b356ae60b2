"""``isagi bench serve``: ISAGI's server beside llama.cpp's own, under the same load.

Owns the side-by-side run: ``isagi serve`` and the anchor, llama.cpp's
``llama-server`` (:mod:`isagi.bench.anchor_build`, :mod:`isagi.bench.anchor_server`),
serving the same GGUF with the same threads and context, driven by the same
closed-loop users (:mod:`isagi.bench.serve_load`). llama-server is sent
ISAGI's system prompt as the chat's system message (ISAGI ignores a client's
and uses its own, the same text), so both models see the same prompt: the run
first checks that the two render the same prompt text and compares one
greedy reply of each (``prompt_check``).

The servers run in pairs of settings (ISAGI's ``ISAGI_PARALLEL`` beside
llama-server's ``-np``, e.g. 1 with 1, then 8 with 8), both up at once, only
one under load at a time. ISAGI starts on an empty data directory of its own
each time (its memory of earlier runs could otherwise answer a question).
For each number of users every round runs both servers on the same questions,
alternating which goes first (ABBA over the cells) so a slow drift of the
machine biases neither; after one unmeasured turn on each. Per server and
setting the figures pool the rounds; for each server the best setting is the
one with the lowest p95 (and, for time to first token, the lowest median),
and ``ratio_p95`` / ``ratio_ttft`` are ISAGI's best over the anchor's.

Each run lasts ``duration_s`` (30 s unless asked otherwise), the users starting
new conversations until then: one conversation per user gave too few turns for
a p95 or a one-user median to mean anything (docs/measurements.md, "Longer runs").

``--hog`` runs instead: one user, each server quiet and then with a busy loop
taking one core beside it (a laptop's other programs), its turn p50 in both,
their ratio and the turns not finished within the deadline.
"""

from __future__ import annotations

import contextlib
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from dataclasses import dataclass, replace
from itertools import zip_longest
from pathlib import Path
from typing import Any

from isagi.bench import anchor_build, anchor_server, live_server
from isagi.bench.serve_load import QUESTIONS, Load, Turns, drive, greedy_reply
from isagi.bench.web import _percentile
from isagi.config import Settings
from isagi.errors import ConfigError, InputError

SERVERS = ("isagi", "anchor")
CHECK_QUESTION = "What is the capital of France, and what is it known for?"


@dataclass
class Options:
    """What ``isagi bench serve`` was asked to run."""

    users: tuple[int, ...] = (1, 8, 16)
    isagi_parallel: tuple[int, ...] = (1, 8)
    anchor_parallel: tuple[int, ...] = (1, 8)
    threads: int | None = None  # None: the settings' (ISAGI_THREADS), else every core
    turns: int = 4
    duration_s: float | None = 30.0  # None: one conversation per user
    max_tokens: int = 32
    rounds: int = 1
    anchor: Path | None = None
    deadline_s: float = 75.0
    start_timeout_s: float = 600.0
    jobs: int = 2  # compile jobs when the anchor is built


def _gguf(settings: Settings) -> Path:
    from isagi.engines.hf.model import default_gguf_path

    if settings.model == "default":
        return default_gguf_path()
    path = Path(settings.model).expanduser()
    if not (path.is_file() and path.suffix.lower() == ".gguf"):
        raise ConfigError(f"isagi bench serve compares llama.cpp servers: --model {settings.model!r} must be a "
                          ".gguf file (or default).")
    return path


def _context(settings: Settings, facts: anchor_server.ModelFacts) -> int:
    """The context per slot of ISAGI's engine: its settings', at most the model's trained one."""
    from isagi.engines import context_per_slot

    wanted = context_per_slot(settings)
    return min(wanted, facts.trained_context) if facts.trained_context > 0 else wanted


def _check(options: Options) -> None:
    if not options.users or min(options.users) < 1:
        raise InputError("--users must list numbers of 1 or more, e.g. 1,8,16.")
    if not options.isagi_parallel and not options.anchor_parallel:
        raise InputError("give at least one setting: --isagi-parallel or --anchor-parallel.")
    if min((*options.isagi_parallel, *options.anchor_parallel)) < 1:
        raise InputError("--isagi-parallel and --anchor-parallel must list numbers of 1 or more, e.g. 1,8.")
    if options.turns < 1 or options.rounds < 1 or options.max_tokens < 1:
        raise InputError("--turns, --rounds and --max-tokens must each be 1 or more.")
    if options.deadline_s <= 0 or (options.duration_s is not None and options.duration_s <= 0):
        raise InputError("--deadline and --duration must be more than 0 seconds.")
    try:
        import openai  # noqa: F401 - a dev dependency; said here, before anything is built or started
    except ImportError:
        raise ConfigError("isagi bench serve drives both servers with the official openai client; "
                          "install it first: pip install openai") from None


@dataclass
class Pair:
    """The two servers of one pair of settings, up at once (either may be absent)."""

    isagi: live_server.LiveServer | None
    anchor: anchor_server.AnchorServer | None
    isagi_setting: int | None
    anchor_setting: int | None

    def url(self, server: str) -> str | None:
        if server == "isagi":
            return self.isagi.url.rstrip("/") if self.isagi else None
        return self.anchor.url if self.anchor else None


@contextlib.contextmanager
def _pair(settings: Settings, binary: Path, gguf: Path, threads: int, ctx: int, options: Options,
          isagi_setting: int | None, anchor_setting: int | None) -> Iterator[Pair]:
    """ISAGI (``ISAGI_PARALLEL=isagi_setting``, a fresh data directory) and the anchor
    (``-np anchor_setting``), started, then stopped."""
    with tempfile.TemporaryDirectory(prefix="isagi-bench-serve-") as tmp:
        home = Path(tmp)
        if settings.profiles_dir.is_dir():  # a profile calibrated there already: not again
            shutil.copytree(settings.profiles_dir, home / "profiles")
        isagi = anchor = None
        try:
            if isagi_setting is not None:
                env = {"ISAGI_PARALLEL": str(isagi_setting), "ISAGI_THREADS": str(threads), "ISAGI_MODEL": settings.model}
                isagi = live_server.start(home, options.start_timeout_s, command="serve", env=env)
            if anchor_setting is not None:
                anchor = anchor_server.start(binary, gguf, threads=threads, ctx_per_slot=ctx, slots=anchor_setting,
                                             timeout_s=options.start_timeout_s)
            yield Pair(isagi, anchor, isagi_setting, anchor_setting)
        finally:
            for server in (anchor, isagi):
                if server is not None:
                    server.stop()


def _figures(runs: list[tuple[Turns, float, tuple[float, float]]], setting: str) -> dict[str, Any]:
    """One server's figures at one setting and number of users, its rounds pooled."""
    lat = [x for t, _w, _l in runs for x in t.latency]
    ttft = [x for t, _w, _l in runs for x in t.ttft]
    per_token = [x for t, _w, _l in runs for x in t.decode_s_per_token]
    tokens = sum(sum(t.tokens) for t, _w, _l in runs)
    wall = sum(w for _t, w, _l in runs)
    tiers: dict[str, int] = {}
    for t, _w, _l in runs:
        for k, v in t.tiers.items():
            tiers[k] = tiers.get(k, 0) + v
    p50_per_token = _percentile(per_token, 0.5)
    return {
        "setting": setting,
        "turns": len(lat),
        "unfinished": sum(t.unfinished for t, _w, _l in runs),
        "not_reached": sum(t.not_reached for t, _w, _l in runs),
        "errors": sum(len(t.errors) for t, _w, _l in runs),
        "p50_s": _percentile(lat, 0.5),
        "p95_s": _percentile(lat, 0.95),
        "ttft_p50_s": _percentile(ttft, 0.5),
        "ttft_p95_s": _percentile(ttft, 0.95),
        "decode_ms_per_token_p50": round(p50_per_token * 1000, 2) if p50_per_token is not None else None,
        "turns_per_s": round(len(lat) / wall, 3) if wall else None,
        "tokens_per_s": round(tokens / wall, 2) if wall else None,
        "reply_tokens_mean": round(tokens / len(lat), 1) if lat else None,
        "loadavg_1m": [[round(b, 2), round(a, 2)] for _t, _w, (b, a) in runs],
        "wall_s": round(wall, 2),
        "tiers": tiers,
        "session_changes": sum(t.session_changes for t, _w, _l in runs),
        "error_samples": [e for t, _w, _l in runs for e in t.errors][:3],
    }


def _best(settings: dict[str, dict[str, Any]], key: str) -> str | None:
    """The setting with the lowest ``key`` (None when no setting has one)."""
    known = {name: f[key] for name, f in settings.items() if f.get(key) is not None}
    return min(known, key=lambda name: known[name]) if known else None


def _ratio(a: float | None, b: float | None) -> float | None:
    return round(a / b, 3) if a is not None and b else None


def _summary(per_setting: dict[str, dict[str, Any]]) -> dict[str, Any]:
    best, best_ttft = _best(per_setting, "p95_s"), _best(per_setting, "ttft_p50_s")
    return {
        "best": best,
        "p95_s": per_setting[best]["p95_s"] if best else None,
        "p50_s": per_setting[best]["p50_s"] if best else None,
        "turns_per_s": per_setting[best]["turns_per_s"] if best else None,
        "tokens_per_s": per_setting[best]["tokens_per_s"] if best else None,
        "best_ttft": best_ttft,
        "ttft_p50_s": per_setting[best_ttft]["ttft_p50_s"] if best_ttft else None,
        "settings": per_setting,
    }


def _label(server: str, setting: int) -> str:
    return f"parallel_{setting}" if server == "isagi" else f"np_{setting}"


def prompt_check(pair: Pair, facts: anchor_server.ModelFacts, system_prompt: str, max_tokens: int) -> dict[str, Any]:
    """Whether both servers render the same prompt (ISAGI's template text against llama-server's
    ``/apply-template``) and how far one greedy reply of each agrees."""
    messages = [{"role": "system", "content": system_prompt}, {"role": "user", "content": CHECK_QUESTION}]
    out: dict[str, Any] = {"question": CHECK_QUESTION}
    anchor_url, isagi_url = pair.url("anchor"), pair.url("isagi")
    if anchor_url:
        anchor_text = anchor_server.applied_template(anchor_url, messages)
        out["same_prompt_text"] = (anchor_text == anchor_server.isagi_prompt_text(facts, messages)
                                   if anchor_text is not None else None)
    if anchor_url and isagi_url:
        # the check's question would stay in ISAGI's memory: asked once, before any measured turn
        replies = {s: greedy_reply(u, system_prompt, CHECK_QUESTION, max_tokens)
                   for s, u in (("isagi", isagi_url), ("anchor", anchor_url))}
        a, b = replies["isagi"], replies["anchor"]
        out.update(isagi_reply=a, anchor_reply=b, same_reply=a == b,
                   common_prefix_chars=len(os.path.commonprefix([a, b])))
    return out


def _runs_of(pair: Pair, options: Options, users: int, first: int, order: tuple[str, ...],
             system_prompt: str, log: list[str]) -> tuple[dict[str, tuple[Turns, float, tuple[float, float]]], int]:
    """One round of one cell: each server of ``order`` under ``users`` users, on the same
    questions from number ``first``; (their runs, the next free question number)."""
    got = {}
    highest = first - 1
    for server in order:
        url = pair.url(server)
        if url is None:
            continue
        load = Load(users=users, turns=options.turns, max_tokens=options.max_tokens, duration_s=options.duration_s,
                    deadline_s=options.deadline_s, system_prompt=system_prompt, first=first)
        setting = pair.isagi_setting if server == "isagi" else pair.anchor_setting
        log.append(f"{users} users: {server} {_label(server, setting or 0)}")
        got[server] = drive(url, load)
        highest = max(highest, got[server][0].highest)
    return got, highest + 1


def _warm(pair: Pair, options: Options, system_prompt: str) -> list[str]:
    """One unmeasured turn on each server (first requests, cold caches), on questions past the
    ones the runs ask; the errors, if any."""
    errors = []
    for server in SERVERS:
        url = pair.url(server)
        if url is not None:
            out, _w, _l = drive(url, Load(users=1, turns=1, max_tokens=options.max_tokens, deadline_s=options.deadline_s,
                                          system_prompt=system_prompt, first=QUESTIONS * 50))
            errors += [f"{server}: {e}" for e in out.errors]
    return errors


def run(settings: Settings, options: Options) -> dict[str, Any]:
    """The side-by-side runs (the module's docstring); their figures as one dict."""
    _check(options)
    gguf = _gguf(settings)
    binary = anchor_build.ensure(settings.home, options.anchor, jobs=options.jobs)
    threads = int(options.threads or settings.threads or os.cpu_count() or 1)
    facts = anchor_server.model_facts(gguf)
    ctx = _context(settings, facts)
    system_prompt = settings.system_prompt
    users_list = sorted(set(options.users))
    runs: dict[int, dict[str, dict[str, list]]] = {n: {s: {} for s in SERVERS} for n in users_list}
    log: list[str] = []
    check: dict[str, Any] = {}
    warm_errors: list[str] = []
    anchor_args: list[str] = []
    cell = 0
    for isagi_setting, anchor_setting in zip_longest(options.isagi_parallel, options.anchor_parallel):
        with _pair(settings, binary, gguf, threads, ctx, options, isagi_setting, anchor_setting) as pair:
            if pair.anchor is not None:
                anchor_args = pair.anchor.args
            if not check:
                check = prompt_check(pair, facts, system_prompt, options.max_tokens)
            warm_errors += _warm(pair, options, system_prompt)
            first = 0  # each pair asks the same questions (ISAGI starts with an empty memory)
            for users in users_list:
                for _ in range(options.rounds):
                    order = SERVERS if cell % 2 == 0 else SERVERS[::-1]
                    cell += 1
                    got, first = _runs_of(pair, options, users, first, order, system_prompt, log)
                    for server, result in got.items():
                        setting = pair.isagi_setting if server == "isagi" else pair.anchor_setting
                        runs[users][server].setdefault(_label(server, setting or 0), []).append(result)
    out_runs = []
    for users in users_list:
        row: dict[str, Any] = {"users": users}
        for server in SERVERS:
            row[server] = _summary({name: _figures(results, name) for name, results in runs[users][server].items()})
        row["ratio_p95"] = _ratio(row["isagi"]["p95_s"], row["anchor"]["p95_s"])
        row["ratio_ttft"] = _ratio(row["isagi"]["ttft_p50_s"], row["anchor"]["ttft_p50_s"])
        row["ratio_turns_per_s"] = _ratio(row["isagi"]["turns_per_s"], row["anchor"]["turns_per_s"])
        out_runs.append(row)
    return {
        "runs": out_runs,
        "prompt_check": check,
        "anchor": {"binary": str(binary), "llama_cpp_python": anchor_build.llama_cpp_version(), "args": anchor_args},
        "isagi": {"command": "isagi serve", "env": "ISAGI_PARALLEL=<setting>, ISAGI_THREADS=<threads>, "
                                                   "an empty ISAGI_HOME per setting"},
        "model": str(gguf),
        "threads": threads,
        "context_per_slot": ctx,
        "turns_per_conversation": options.turns,
        "duration_s": options.duration_s,
        "max_tokens": options.max_tokens,
        "rounds": options.rounds,
        "order": log,
        "warmup_errors": warm_errors[:5],
        "cpus": os.cpu_count(),
        "note": "closed loop, streamed, greedy; latency = request to the stream's end, ttft = to the first "
                "text chunk; turns/s and tokens/s over the run's wall time; loadavg_1m = before and after "
                "each run; best = the setting with the lowest p95 (best_ttft: lowest ttft p50); "
                "ratios = ISAGI's best / the anchor's best",
    }


@contextlib.contextmanager
def busy_core() -> Iterator[subprocess.Popen]:
    """A process spinning on one core (a busy loop) for the block's time."""
    proc = subprocess.Popen([sys.executable, "-c", "while True: pass"], stdin=subprocess.DEVNULL)
    try:
        yield proc
    finally:
        proc.kill()
        proc.wait(30)


def run_hog(settings: Settings, options: Options) -> dict[str, Any]:
    """One user on each server, quiet and then beside a one-core busy loop; their turn p50s,
    the ratio and the turns not finished within ``options.deadline_s``."""
    options = replace(options, users=(1,))
    _check(options)
    gguf = _gguf(settings)
    binary = anchor_build.ensure(settings.home, options.anchor, jobs=options.jobs)
    threads = int(options.threads or settings.threads or os.cpu_count() or 1)
    facts = anchor_server.model_facts(gguf)
    ctx = _context(settings, facts)
    isagi_setting = options.isagi_parallel[0] if options.isagi_parallel else None
    anchor_setting = options.anchor_parallel[0] if options.anchor_parallel else None
    got: dict[str, dict[str, list]] = {s: {"quiet": [], "hog": []} for s in SERVERS}
    log: list[str] = []
    with _pair(settings, binary, gguf, threads, ctx, options, isagi_setting, anchor_setting) as pair:
        warm_errors = _warm(pair, options, settings.system_prompt)
        first = 0
        for r in range(options.rounds):
            for server in SERVERS if r % 2 == 0 else SERVERS[::-1]:
                url = pair.url(server)
                if url is None:
                    continue
                for phase in ("quiet", "hog"):
                    load = Load(users=1, turns=options.turns, max_tokens=options.max_tokens,
                                duration_s=options.duration_s, deadline_s=options.deadline_s,
                                system_prompt=settings.system_prompt, first=first)
                    log.append(f"{server} {phase}")
                    with busy_core() if phase == "hog" else contextlib.nullcontext():
                        result = drive(url, load)
                    got[server][phase].append(result)
                    first = result[0].highest + 1
    out: dict[str, Any] = {}
    for server in SERVERS:
        setting = isagi_setting if server == "isagi" else anchor_setting
        if setting is None:
            continue
        quiet = _figures(got[server]["quiet"], _label(server, setting))
        hog = _figures(got[server]["hog"], _label(server, setting))
        out[server] = {
            "setting": _label(server, setting),
            "quiet_p50_s": quiet["p50_s"],
            "hog_p50_s": hog["p50_s"],
            "ratio_p50": _ratio(hog["p50_s"], quiet["p50_s"]),
            "hog_finished": hog["turns"],
            "hog_unfinished": hog["unfinished"] + hog["not_reached"],
            "quiet": quiet,
            "hog": hog,
        }
    return {
        "hog": out,
        "threads": threads,
        "deadline_s": options.deadline_s,
        "turns_per_conversation": options.turns,
        "duration_s": options.duration_s,
        "max_tokens": options.max_tokens,
        "rounds": options.rounds,
        "order": log,
        "warmup_errors": warm_errors[:5],
        "cpus": os.cpu_count(),
        "note": "1 user; hog = a Python busy loop on one core beside both servers during the hog runs; "
                "ratio_p50 = hog p50 / quiet p50; a turn not finished within deadline_s is given up and "
                "ends its conversation (hog_unfinished counts it and the turns after it)",
    }


def _num(value: Any) -> str:
    return "-" if value is None else f"{value:.3g}" if isinstance(value, float) else str(value)


def _short(setting: str) -> str:
    """A setting's name in the table: ``parallel_8`` as ``P=8``, ``np_8`` as ``np=8``."""
    kind, _, n = setting.rpartition("_")
    return f"{'P' if kind == 'parallel' else kind}={n}"


def table(data: dict[str, Any]) -> Any:
    """The figures of :func:`run` or :func:`run_hog` as a rich table (* the best setting)."""
    from rich import box
    from rich.table import Table

    if "hog" in data:
        t = Table(title=f"1 user, quiet and beside a one-core busy loop ({data['threads']} threads, "
                        f"deadline {data['deadline_s']:g} s)", box=box.SIMPLE)
        for col in ("server", "setting", "quiet p50", "hog p50", "hog/quiet", "done", "unfinished"):
            t.add_column(col, justify="left" if col in ("server", "setting") else "right")
        for server, f in data["hog"].items():
            t.add_row(server, _short(f["setting"]), _num(f["quiet_p50_s"]), _num(f["hog_p50_s"]),
                      _num(f["ratio_p50"]), _num(f["hog_finished"]), _num(f["hog_unfinished"]))
        return t
    t = Table(title=f"isagi serve beside llama-server: {data['threads']} threads, {data['max_tokens']}-token greedy "
                    "replies (seconds; * best setting; P = ISAGI_PARALLEL, np = -np; lost: failed, unfinished "
                    "or not reached)", box=box.SIMPLE, padding=0)
    for col in ("users", "server", "set", "p50", "p95", "ttft", "ms/tok", "turn/s", "tok/s", "load", "ok", "lost"):
        t.add_column(col, justify="left" if col in ("server", "set") else "right", min_width=min(len(col), 6))
    for row in data["runs"]:
        for server in SERVERS:
            summary = row[server]
            for name, f in summary["settings"].items():
                load = max((a for _b, a in f["loadavg_1m"]), default=None)
                t.add_row(str(row["users"]), server, _short(name) + ("*" if name == summary["best"] else ""),
                          _num(f["p50_s"]), _num(f["p95_s"]), _num(f["ttft_p50_s"]), _num(f["decode_ms_per_token_p50"]),
                          _num(f["turns_per_s"]), _num(f["tokens_per_s"]), _num(load), _num(f["turns"]),
                          _num(f["errors"] + f["unfinished"] + f["not_reached"]))
        t.add_row(str(row["users"]), "ratio", "i/a", "", _num(row["ratio_p95"]), _num(row["ratio_ttft"]), "",
                  _num(row["ratio_turns_per_s"]), "", "", "", "", end_section=True)
    return t
