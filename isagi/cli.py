"""The ``isagi`` command line: parse, call, print.

Every command is thin: it builds :class:`~isagi.config.Settings` from the
environment plus its flags, calls one function of the package, and prints.
User-facing errors (:class:`~isagi.errors.IsagiError`) end the command with a
one-line message and exit status 2, never a traceback.
"""

from __future__ import annotations

import datetime
import functools
import io
import json
import sys
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Annotated, Any, NoReturn, TypeVar

import typer
from rich.console import Console

from isagi import __version__
from isagi.config import Settings, load_settings
from isagi.errors import InputError, IsagiError
from isagi.storage.owners import LOCAL_OWNER

app = typer.Typer(add_completion=False, no_args_is_help=True, help="ISAGI: chat with a living model.")
bench_app = typer.Typer(no_args_is_help=True, help="Benchmarks (speed, memory, size).")
eval_app = typer.Typer(no_args_is_help=True, help="Evaluations (tiers, safety, exploration).")
sessions_app = typer.Typer(no_args_is_help=True, help="Browse the history store.")
profile_app = typer.Typer(no_args_is_help=True, help="The per-model calibration profile.")
app.add_typer(bench_app, name="bench")
app.add_typer(eval_app, name="eval")
app.add_typer(sessions_app, name="sessions")
app.add_typer(profile_app, name="profile")

err = Console(stderr=True)
out = Console()
F = TypeVar("F", bound=Callable[..., Any])

ModelOpt = Annotated[str | None, typer.Option("--model", help="default | hub id | local dir (ISAGI_MODEL)")]
BackendOpt = Annotated[str | None, typer.Option("--backend", help="auto | llamacpp | transformers (ISAGI_BACKEND)")]
QuantOpt = Annotated[str | None, typer.Option("--quant", help="nf4 | none (ISAGI_QUANT)")]
DeviceOpt = Annotated[str | None, typer.Option("--device", help="auto | cpu | cuda (ISAGI_DEVICE)")]
HomeOpt = Annotated[Path | None, typer.Option("--home", help="data directory (ISAGI_HOME)")]
LayerOpt = Annotated[int | None, typer.Option("--layer", help="hidden-state layer (ISAGI_LAYER)")]
KOpt = Annotated[int | None, typer.Option("--k", help="UGT dimensions (ISAGI_K)")]
JsonOpt = Annotated[bool, typer.Option("--json", help="print one JSON object")]
ParallelOpt = Annotated[int | None, typer.Option(
    "--parallel", help="llama.cpp: replies decoded at once, one sequence slot each (ISAGI_PARALLEL)")]
# the servers' (isagi web, isagi serve)
HostOpt = Annotated[str, typer.Option("--host", envvar="ISAGI_HOST", help="address to bind (loopback by default)")]
PortOpt = Annotated[int, typer.Option("--port", envvar="ISAGI_PORT", help="port to listen on")]
TrustedProxiesOpt = Annotated[str | None, typer.Option(
    "--trusted-proxies", help="comma-separated proxy addresses or networks whose X-Forwarded-For "
    "is believed (ISAGI_TRUSTED_PROXIES); none by default")]


def friendly(fn: F) -> F:
    """Turn user-facing errors into a one-line message and exit status 2."""

    @functools.wraps(fn)
    def wrapper(*args: Any, **kwargs: Any) -> Any:
        try:
            return fn(*args, **kwargs)
        except IsagiError as exc:
            err.print(f"[bold red]error:[/] {exc}", highlight=False, soft_wrap=True)
            raise typer.Exit(2) from None
        except KeyboardInterrupt:
            raise typer.Exit(130) from None

    return wrapper  # type: ignore[return-value]


def _settings(**overrides: Any) -> Settings:
    return load_settings(**overrides)


def _progress_printer() -> Callable[[str, int, int], None]:
    """A progress callback for profile calibration that prints to stderr."""
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn

    bar = Progress(TextColumn("{task.description}"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(), console=err, transient=False)
    tasks: dict[str, Any] = {}

    def update(stage: str, done: int, total: int) -> None:
        if not bar.live.is_started:
            bar.start()
        if stage not in tasks:
            tasks[stage] = bar.add_task(stage, total=total)
        bar.update(tasks[stage], completed=done, total=total)
        if all(t.finished for t in bar.tasks):
            bar.stop()

    return update


def _engine(settings: Settings, *, with_store: bool = True) -> Any:
    from isagi.pipeline.engine import Engine

    return Engine.start(settings, with_store=with_store, progress=_progress_printer())


def _json_default(value: Any) -> Any:
    """Times as ISO 8601 text, anything else number-like as a float (numpy scalars)."""
    if isinstance(value, datetime.datetime | datetime.date):
        return value.isoformat()
    return float(value)


def _print_json(obj: Any) -> None:
    sys.stdout.write(json.dumps(obj, indent=None, default=_json_default) + "\n")


def _version(value: bool) -> None:
    if value:
        out.print(f"isagi {__version__}")
        raise typer.Exit()


@app.callback()
def root(
    version: Annotated[bool, typer.Option("--version", callback=_version, is_eager=True, help="print the version")] = False,
) -> None:
    """ISAGI: chat with a 4-bit model that keeps a living manifold of the conversation."""


@app.command()
@friendly
def info(model: ModelOpt = None, backend: BackendOpt = None, quant: QuantOpt = None, device: DeviceOpt = None, home: HomeOpt = None, parallel: ParallelOpt = None, as_json: JsonOpt = False) -> None:
    """Model, quantisation, device and why, data directory, memory footprint, sequence slots."""
    from isagi.engines import load_engine

    # the engine as the servers open it (isagi web, serve): their sequence slots and KV memory
    settings = _settings(model=model, backend=backend, quant=quant, device=device, home=home,
                         parallel=parallel).for_server()
    lm = load_engine(settings)
    facts = {
        "isagi": __version__,
        "backend": lm.backend,
        "backend_reason": lm.backend_reason,
        "model": lm.model_id,
        "source": lm.source,
        "fingerprint": lm.fingerprint,
        "quantisation": lm.quant,
        "device": str(lm.device),
        "device_reason": lm.device_reason,
        "layers": lm.num_layers,
        "hidden_size": lm.hidden_size,
        "layer": settings.layer or lm.default_layer,
        "safety_layer": settings.safety_layer or lm.default_safety_layer,
        "k": settings.k,
        "data_directory": str(settings.home),
        "database": settings.resolved_database_url,
        "memory_footprint_mb": round(lm.footprint_bytes() / 2**20, 1),
        # replies isagi web decodes at once (ISAGI_PARALLEL; 1 on the transformers backend) and
        # what their KV caches take when full
        "parallel": getattr(lm, "slots", 1),
        "kv_cache_mb": round(lm.kv_cache_bytes() / 2**20, 1) if hasattr(lm, "kv_cache_bytes") else None,
    }
    if as_json:
        _print_json(facts)
        return
    for key, value in facts.items():
        out.print(f"[bold]{key:>20}[/]  {value}", highlight=False)


@app.command()
@friendly
def chat(
    model: ModelOpt = None, backend: BackendOpt = None,
    quant: QuantOpt = None,
    device: DeviceOpt = None,
    home: HomeOpt = None,
    layer: LayerOpt = None,
    k: KOpt = None,
    load: Annotated[Path | None, typer.Option("--load", help="resume a .miku session")] = None,
    save: Annotated[Path | None, typer.Option("--save", help="save the session to this .miku file")] = None,
    max_new_tokens: Annotated[int | None, typer.Option("--max-new-tokens")] = None,
    sample: Annotated[bool, typer.Option("--sample", help="sample instead of greedy decoding")] = False,
    temperature: Annotated[float, typer.Option("--temperature")] = 0.7,
    top_p: Annotated[float, typer.Option("--top-p")] = 0.9,
    seed: Annotated[int | None, typer.Option("--seed")] = None,
    system: Annotated[str | None, typer.Option("--system", help="system prompt (ISAGI_SYSTEM_PROMPT)")] = None,
    allow_other_model: Annotated[bool, typer.Option("--allow-other-model", help="load a .miku made with another model")] = False,
    verbose: Annotated[bool, typer.Option("--verbose", "-v", help="show tier, distance and TEH per turn")] = False,
    quiet: Annotated[bool, typer.Option("--quiet", "-q", help="leave out the line saying what each turn was")] = False,
) -> None:
    """Chat in the terminal. With a pipe, reads one message per line and prints one reply per line.

    The line /regenerate runs your last question again (sampled) and replaces its reply in the
    session, its file and the history.
    """
    from isagi.console.terminal import HELP as REGENERATE_HELP
    from isagi.console.terminal import chat_loop
    from isagi.datadir import open_data_dir
    from isagi.engines.base import GenerationOptions
    from isagi.session.files import load_session

    settings = _settings(model=model, backend=backend, quant=quant, device=device, home=home, layer=layer, k=k,
                         max_new_tokens=max_new_tokens, system_prompt=system)
    data = open_data_dir(settings)  # an unwritable data directory ends here; alone: the history is repaired
    for line in data.lines():
        err.print(f"[dim]{line}[/]", highlight=False)
    engine = _engine(settings)
    if load is not None:
        session = load_session(engine.frame, load, allow_other_model=allow_other_model)
    else:
        session = engine.new_session()
    if save is not None:
        session.miku_path = save
    options = GenerationOptions(max_new_tokens=settings.max_new_tokens, do_sample=sample,
                                temperature=temperature, top_p=top_p, seed=seed)
    interactive = sys.stdin.isatty()
    # Undecodable input (e.g. invalid UTF-8 in a pipe) arrives as lone surrogates, which
    # the engine's validation refuses with one line, instead of a decoding traceback here.
    if isinstance(sys.stdin, io.TextIOWrapper):
        sys.stdin.reconfigure(errors="surrogateescape")
    if interactive:
        err.print(f"[dim]ISAGI {__version__} · {engine.lm.model_id} · {engine.lm.quant} on {engine.lm.device} · "
                  f"session {session.id} · Ctrl-C stops a reply · Ctrl-C at the prompt or Ctrl-D quits · "
                  f"{REGENERATE_HELP}[/]")
    chat_loop(engine, session, options, interactive=interactive, out=out, err=err, verbose=verbose, quiet=quiet)
    if save is not None:
        err.print(f"[dim]session saved to {save}[/]")


@app.command()
@friendly
def web(
    host: HostOpt = "127.0.0.1", port: PortOpt = 7860,
    model: ModelOpt = None, backend: BackendOpt = None, quant: QuantOpt = None, device: DeviceOpt = None,
    home: HomeOpt = None, trusted_proxies: TrustedProxiesOpt = None, parallel: ParallelOpt = None,
) -> None:
    """Open the browser app on http://HOST:PORT."""
    from isagi.app.server import serve

    serve(_settings(model=model, backend=backend, quant=quant, device=device, home=home,
                    trusted_proxies=trusted_proxies, parallel=parallel), host=host, port=port)


@app.command()
@friendly
def serve(
    host: HostOpt = "127.0.0.1", port: PortOpt = 7860,
    model: ModelOpt = None, backend: BackendOpt = None, quant: QuantOpt = None, device: DeviceOpt = None,
    home: HomeOpt = None, trusted_proxies: TrustedProxiesOpt = None, parallel: ParallelOpt = None,
) -> None:
    """Serve the OpenAI-compatible API alone (no page) on http://HOST:PORT/v1."""
    from isagi.app.server import serve as serve_app

    serve_app(_settings(model=model, backend=backend, quant=quant, device=device, home=home,
                        trusted_proxies=trusted_proxies, parallel=parallel), host=host, port=port, page=False)


@app.command()
@friendly
def explore(
    seed_concept: Annotated[str, typer.Argument(help="the concept to explore from")],
    steps: Annotated[int, typer.Option("--steps", min=1, max=6, help="steered steps (1-6)")] = 3,
    unsafe_regular: Annotated[bool, typer.Option("--regular", help="regular (unprojected) OGD, for comparison")] = False,
    model: ModelOpt = None, backend: BackendOpt = None,
    home: HomeOpt = None,
    as_json: JsonOpt = False,
) -> None:
    """Safe OGD concept exploration: a chain of steered steps, TEH per step, MIKU index."""
    from isagi.explore.chains import explore_on

    engine = _engine(_settings(model=model, backend=backend, home=home), with_store=False)
    result = explore_on(engine, seed_concept, steps=steps, safe=not unsafe_regular)
    data = result.to_dict()
    if as_json:
        _print_json(data)
        return
    for i, step in enumerate(data["steps"], 1):
        out.print(f"[bold]step {i}[/] α={step['alpha']:.2f} TEH={step['teh']:.1f}% coherence={step['coherence']:.2f}")
        out.print(step["text"], highlight=False, markup=False)
    mcb = data.get("mcb", {})
    out.print(f"[bold]MIKU creativity index[/] {mcb.get('index')} (tier {mcb.get('tier')})")


# -- profile -------------------------------------------------------------------


def _probe_words(s: Any) -> str:
    """What kind of probe a safety profile's prompt guard is, in words."""
    probe = s.details.get("probe", {})
    if s.hidden is None:
        return "a logistic probe"
    return (f"an average of {probe.get('members', '?')} small ReLU networks "
            f"({probe.get('hidden', '?')} units each)")


@profile_app.command("show")
@friendly
def profile_show(model: ModelOpt = None, backend: BackendOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Show the profile of the configured model (calibrating first if needed), with the TEH ROC."""
    engine = _engine(_settings(model=model, backend=backend, home=home), with_store=False)
    p = engine.profile
    s = p.safety
    roc = s.roc
    data = {
        "key": p.key, "model_fingerprint": p.model_fingerprint, "layer": p.layer, "k": int(p.basis.B.shape[1]),
        "explained_variance": p.basis.explained, "zones": p.zones.names, "context_threshold": p.context_threshold,
        "safety_layer": s.layer, "safety_read_layers": s.read_layers,
        "safety_state": "at each read layer, the average of the mean state over the message's tokens and the mean "
                        "over the template tokens after the message; the layers side by side",
        "prompt_guard": (f"{_probe_words(s)} over layers {', '.join(map(str, s.read_layers))}: "
                         "TEH = 100 sigmoid(logit)" if s.weights is not None else "share of norm in the forbidden subspace"),
        "teh_threshold": s.threshold, "teh_reply_threshold": s.reply_threshold, "forbidden_dims": int(s.Q.shape[1]),
        "reply_guard": ("the reply judged with its prompt: the prompt probe's logit of the newest 8 reply states "
                        "beside its logit of the prompt, weighed by a logistic head" if s.reply_Q is not None
                        else "reply windows in the prompt subspace"),
        "threshold_rule": s.details.get("threshold_rule"),
        "safety_categories": list(s.categories), "roc_auc_out_of_fold": roc.get("auc"),
        "safety_cv": s.details.get("cv"), "report": p.report,
    }
    if as_json:
        data["roc"] = roc
        _print_json(data)
        return
    for key, value in data.items():
        out.print(f"[bold]{key:>22}[/]  {value}", highlight=False)
    out.print("[bold]TEH ROC on calibration[/] (threshold → TPR / FPR)")
    for t, tpr, fpr in list(zip(roc["thresholds"], roc["tpr"], roc["fpr"], strict=False))[:: max(1, len(roc["thresholds"]) // 12)]:
        out.print(f"  {t:8.2f}%  →  {tpr:.3f} / {fpr:.3f}")


@profile_app.command("build")
@friendly
def profile_build(
    out_dir: Annotated[Path, typer.Option("--out", help="directory to write the profile into (as <key>/)")],
    model: ModelOpt = None, backend: BackendOpt = None, home: HomeOpt = None,
) -> None:
    """Calibrate the configured model now (no cache is read) and write its profile to --out.

    `isagi profile build --out isagi/profiles --backend llamacpp` (and
    `--backend transformers`) remakes the profiles that ship with the package.
    """
    from isagi.engines import load_engine
    from isagi.profile import build_for, save_profile

    settings = _settings(model=model, backend=backend, home=home)
    lm = load_engine(settings)
    started = time.perf_counter()
    profile = build_for(lm, settings, progress=_progress_printer())
    path = save_profile(profile, out_dir)
    out.print(f"profile {profile.key} ({lm.backend}, {lm.model_id}) written to {path} "
              f"in {time.perf_counter() - started:.0f} s", highlight=False)


# -- sessions and files --------------------------------------------------------


OwnerOpt = Annotated[str, typer.Option(
    "--owner", help="whose sessions: `local` (made without a login) or a web login's user name")]


def _store(home: Path | None) -> Any:
    from isagi.storage.history import HistoryStore

    return HistoryStore(_settings(home=home).resolved_database_url)


@sessions_app.command("list")
@friendly
def sessions_list(home: HomeOpt = None, limit: int = 50, as_json: JsonOpt = False,
                  owner: OwnerOpt = LOCAL_OWNER) -> None:
    """Past sessions of one owner, newest first."""
    rows = _store(home).list_sessions(limit=limit, owner=owner)
    if as_json:
        _print_json([{k: (v.isoformat() if hasattr(v, "isoformat") else v) for k, v in r.__dict__.items()}
                     for r in rows])
        return
    if not rows:
        out.print(f"No sessions of owner {owner!r} in the history store yet.", highlight=False)
        return
    from isagi.console.tables import sessions_table

    out.print(sessions_table(rows))


@sessions_app.command("show")
@friendly
def sessions_show(session_id: str, home: HomeOpt = None, owner: OwnerOpt = LOCAL_OWNER) -> None:
    """Print a session as Markdown."""
    out.print(_store(home).export(session_id, "markdown", owner=owner), highlight=False, markup=False)


@sessions_app.command("search")
@friendly
def sessions_search(text: str, home: HomeOpt = None, limit: int = 50, owner: OwnerOpt = LOCAL_OWNER) -> None:
    """Find messages containing TEXT."""
    for hit in _store(home).search(text, limit=limit, owner=owner):
        data = hit.__dict__
        out.print(f"{data.get('session_id')}  [{data.get('role')}] {str(data.get('text'))[:120]}", highlight=False, markup=False)


@sessions_app.command("export")
@friendly
def sessions_export(session_id: str, fmt: Annotated[str, typer.Option("--format", help="json | markdown")] = "markdown",
                    output: Annotated[Path | None, typer.Option("--output", "-o")] = None, home: HomeOpt = None,
                    owner: OwnerOpt = LOCAL_OWNER) -> None:
    """Export a session as JSON or Markdown."""
    text = _store(home).export(session_id, fmt, owner=owner)
    if output is None:
        sys.stdout.write(text + ("" if text.endswith("\n") else "\n"))
    else:
        output.write_text(text)


@sessions_app.command("prune")
@friendly
def sessions_prune(older_than: Annotated[float, typer.Option(
                       "--older-than", help="days since a session was last updated, e.g. 30")],
                   dry_run: Annotated[bool, typer.Option("--dry-run", help="only list what would go")] = False,
                   home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Delete every session (of every owner) last updated more than --older-than days ago: its
    history rows and its autosaved .miku. What ISAGI_SESSION_RETENTION has a server do daily."""
    from isagi.datadir import no_other_process
    from isagi.session.retention import prune_sessions
    from isagi.session.store import session_files

    if not older_than > 0:
        raise InputError(f"--older-than {older_than:g}: give a number of days above 0, e.g. 30.")
    settings = _settings(home=home)
    store = _store(home)
    with no_other_process(settings, "removing sessions"):  # a server would save its open ones again
        pruned = prune_sessions(store, session_files(settings), older_than, dry_run=dry_run)
    if as_json:
        _print_json({"dry_run": dry_run, "older_than_days": older_than, "sessions": pruned.sessions,
                     "files": [str(p) for p in pruned.files]})
        return
    verb = "Would delete" if dry_run else "Deleted"
    out.print(f"{verb} {len(pruned.sessions)} session(s) and {len(pruned.files)} file(s) "
              f"last updated more than {older_than:g} days ago.", highlight=False, markup=False)
    for sid in pruned.sessions:
        out.print(f"  {sid}", highlight=False, markup=False)


def _no_such_session(session_id: str, owner: str) -> NoReturn:
    err.print(f"No session {session_id!r} of owner {owner!r}; `isagi sessions list --owner {owner}` shows the ids.",
              highlight=False, markup=False)
    raise typer.Exit(1)


def _own_summary(store: Any, session_id: str, owner: str) -> Any:
    """``owner``'s history summary of ``session_id``; exits 1 saying how to find the ids when there is none."""
    try:
        summary = store.get_session(session_id, owner=owner)
    except IsagiError:
        summary = None
    if summary is None:
        _no_such_session(session_id, owner)
    return summary


@contextmanager
def _held_here(files: Any, store: Any, session_id: str, verb: str) -> Iterator[Any]:
    """The CLI's hold on a session it writes (``verb``: rename, delete): with a session store that
    servers share, its lease, giving the fence its writes carry (None: a local folder, no leases);
    :class:`SessionBusy` (:data:`~isagi.errors.OPEN_ON_A_SERVER`) while a server holds it or takes
    it meanwhile."""
    from isagi.errors import OPEN_ON_A_SERVER, SessionBusy, SessionMoved
    from isagi.session.lease import maintenance_holds

    refusal = OPEN_ON_A_SERVER.format(sid=session_id, verb=verb)
    with maintenance_holds(files, store) as hold, hold(session_id) as claim:
        if not claim.free:
            raise SessionBusy(refusal)
        try:
            yield claim.fence
        except SessionMoved:  # a server took it while this ran: nothing more written
            raise SessionBusy(refusal) from None


@sessions_app.command("rename")
@friendly
def sessions_rename(session_id: str, title: str, home: HomeOpt = None, owner: OwnerOpt = LOCAL_OWNER) -> None:
    """Give a session a new TITLE: in the history store and in its saved .miku (the page's chat
    list shows it). Refused while a server uses the data directory, or (with a session store that
    servers share, ISAGI_SESSIONS_URL) while one of them has the session open: rename it in that
    server's page instead."""
    from isagi.datadir import no_other_process
    from isagi.session.files import retitle_file
    from isagi.session.store import session_files
    from isagi.storage.titles import make_title

    if not title.strip():
        raise InputError("Give a title with at least one character that is not a space.")
    settings = _settings(home=home)
    store = _store(home)
    summary = _own_summary(store, session_id, owner)
    new = make_title(title)
    with no_other_process(settings, "renaming a session", "rename it in the server's page"):  # a server's open copy would save its old title
        files = session_files(settings)
        # shared: under the session's lease, the writes fenced (a server's open copy would save its old title)
        with _held_here(files, store, session_id, "rename") as fence:
            path = files.find(session_id, summary.miku_path)
            if path is not None:
                retitle_file(path, new, files=files, fence=fence)
            store.rename_session(session_id, new, owner=owner, fence=fence)
    out.print(f"Session {session_id} is now titled {new!r}.", highlight=False, markup=False)


@sessions_app.command("delete")
@friendly
def sessions_delete(session_id: str, home: HomeOpt = None, owner: OwnerOpt = LOCAL_OWNER) -> None:
    """Delete a session, its turns and its autosaved .miku. With a session store that servers
    share (ISAGI_SESSIONS_URL), refused while one of them has the session open."""
    from isagi.session.store import session_files

    settings = _settings(home=home)
    store = _store(home)
    summary = _own_summary(store, session_id, owner)
    files = session_files(settings)
    # shared: under the session's lease, the writes fenced (a server saving it would bring it back)
    with _held_here(files, store, session_id, "delete") as fence:
        if not store.delete_session(session_id, owner=owner, fence=fence):
            _no_such_session(session_id, owner)
        removed = files.remove(session_id, summary.miku_path, fence=fence)
    note = f" and {removed[0].name}" if removed else ""
    out.print(f"Deleted session {session_id}{note}.", highlight=False, markup=False)


@app.command()
@friendly
def inspect(
    path: Path, as_json: JsonOpt = False, model: ModelOpt = None, home: HomeOpt = None,
    any_model: Annotated[bool, typer.Option("--any-model", help="judge the file alone, whatever model saved it")] = False,
) -> None:
    """Header, sizes, trajectories, metric growth and checksum status of a .miku file.

    Exits 1, saying why, if loading the file would be refused (a damaged
    checksum, impossible values, another model than the configured one: ISAGI_MODEL
    or --model, unless --any-model); 2 if it cannot be read at all.
    """
    from isagi.console.tables import inspect_tables
    from isagi.engines import model_fingerprint
    from isagi.session.files import session_from_state
    from isagi.storage.miku import inspect_miku

    # the loader's own judgement (what chat --load and the page would say), without a model
    data = inspect_miku(path, check=lambda state: session_from_state(state, "the session"))
    expected = None if any_model else model_fingerprint(_settings(model=model, home=home))
    got = str((data.get("header") or {}).get("model_fingerprint", ""))
    if not data["refused"] and expected is not None and got != expected:
        data["refused"] = (f"it was saved with model {str(data['header'].get('model_id'))[:80]!r} (fingerprint "
                           f"{got[:16]}), not the configured model (fingerprint {expected[:16]}); chat --load "
                           "and the page refuse it (chat --load --allow-other-model takes it anyway)")
    if as_json:
        _print_json(data)
    else:
        for table in inspect_tables(data):
            out.print(table)
    if data["refused"]:
        err.print(f"refused: {path} would not load: {data['refused']}", highlight=False, markup=False,
                  soft_wrap=True)
        raise typer.Exit(1)


@app.command("import-legacy")
@friendly
def import_legacy(old: Path, new: Path) -> None:
    """Convert a research-code miku-v1 pair (OLD.miku + OLD.miku.pt) to a .miku v2 file."""
    from isagi.session.files import import_legacy as convert

    convert(old, new)
    out.print(f"wrote {new}")


# -- benchmarks ------------------------------------------------------------------


@bench_app.command("generate")
@friendly
def bench_generate(model: ModelOpt = None, backend: BackendOpt = None, device: DeviceOpt = None, home: HomeOpt = None,
                   new_tokens: int = 64, repeats: int = 5, as_json: JsonOpt = False) -> None:
    """Tokens/s and time to first token for nf4 and none; capture overhead vs plain generate."""
    from isagi.bench.generate import run

    _report(run(_settings(model=model, backend=backend, device=device, home=home), new_tokens=new_tokens, repeats=repeats), as_json)


@bench_app.command("turn")
@friendly
def bench_turn(model: ModelOpt = None, backend: BackendOpt = None, home: HomeOpt = None, new_tokens: int = 64, repeats: int = 9,
               history: Annotated[str | None, typer.Option(
                   "--history", help="earlier exchanges in the session, e.g. 10,100,1000: turn times late in long "
                                     "sessions instead, with ratios to the smallest")] = None,
               turns: Annotated[int, typer.Option("--turns", help="with --history: new turns timed per session")] = 16,
               as_json: JsonOpt = False) -> None:
    """A full turn vs plain generation of the same reply; RETRIEVE vs a generated turn (or, with
    --history, a turn's cost after many earlier exchanges)."""
    settings = _settings(model=model, backend=backend, home=home)
    if history is not None:
        from isagi.bench.turn import run_history

        _report(run_history(settings, _count_list(history, "--history"), new_tokens=new_tokens, turns=turns), as_json)
        return
    from isagi.bench.turn import run

    _report(run(settings, new_tokens=new_tokens, repeats=repeats), as_json)


@bench_app.command("stop")
@friendly
def bench_stop(model: ModelOpt = None, backend: BackendOpt = None, home: HomeOpt = None,
               as_json: JsonOpt = False) -> None:
    """Stop during a ~2,000-token prompt's evaluation: the time from Stop to the turn's end."""
    from isagi.bench.stop import run

    _report(run(_settings(model=model, backend=backend, home=home)), as_json)


@bench_app.command("batch")
@friendly
def bench_batch(model: ModelOpt = None, home: HomeOpt = None, new_tokens: int = 48, repeats: int = 3,
                widths: Annotated[str, typer.Option("--widths", help="concurrent replies, e.g. 1,2,4,8,16")] = "1,2,4,8,16",
                as_json: JsonOpt = False) -> None:
    """Aggregate tokens/s with several replies at once: ISAGI's llama.cpp engine next to plain
    llama-cpp-python decoding them in one multi-sequence batch (the anchor), in one run."""
    from isagi.bench.batch import run

    _report(run(_settings(model=model, home=home), new_tokens=new_tokens, repeats=repeats,
                widths=tuple(_count_list(widths, "--widths"))), as_json)


@bench_app.command("lookup")
@friendly
def bench_lookup(n: int = 100_000, k: int = 64, queries: int = 1000, as_json: JsonOpt = False) -> None:
    """Two-stage lookup latency and recall against exact metric search."""
    from isagi.bench.lookup import run

    _report(run(n=n, k=k, queries=queries), as_json)


@bench_app.command("cog")
@friendly
def bench_cog(interactions: int = 10_000, k: int = 64, as_json: JsonOpt = False) -> None:
    """A long soak of the manifold: metric health, growth, memory, lookup latency."""
    from isagi.bench.cog import run

    _report(run(interactions=interactions, k=k), as_json)


@bench_app.command("miku")
@friendly
def bench_miku(turns: int = 5_000, k: int = 64, as_json: JsonOpt = False) -> None:
    """Save/load time and size of a long session, against the legacy format."""
    from isagi.bench.miku import run

    _report(run(turns=turns, k=k), as_json)


@bench_app.command("web")
@friendly
def bench_web(url: Annotated[str | None, typer.Option("--url", help="a running server; default: start one")] = None,
              sessions: int = 8, turns: int = 5, home: HomeOpt = None,
              history: Annotated[str | None, typer.Option(
                  "--history", help="earlier exchanges each session loads first, e.g. 10,1000: one pass "
                                    "per number on one server, with latency ratios to the smallest")] = None,
              as_json: JsonOpt = False) -> None:
    """Concurrent sessions through the HTTP API against a live server on loopback."""
    settings = _settings(home=home)
    if history is not None:
        from isagi.bench.web import run_history

        _report(run_history(url, _count_list(history, "--history"), sessions=sessions, turns=turns,
                            settings=settings), as_json)
        return
    from isagi.bench.web import run

    _report(run(url, sessions=sessions, turns=turns, settings=settings), as_json)


@bench_app.command("api")
@friendly
def bench_api(url: Annotated[str | None, typer.Option("--url", help="a running server; default: start one")] = None,
              sessions: int = 8, turns: int = 5, home: HomeOpt = None,
              rounds: Annotated[int, typer.Option(
                  "--rounds", help="rounds of both parts, in ABBA order (api web, web api, ...; an even count balances it)")] = 2,
              as_json: JsonOpt = False) -> None:
    """Turn latency through the OpenAI-compatible API next to bench web's, on one live server (api / web)."""
    from isagi.bench.api import run

    _report(run(url, sessions=sessions, turns=turns, settings=_settings(home=home), rounds=rounds), as_json)


@bench_app.command("balancer")
@friendly
def bench_balancer(url: Annotated[str | None, typer.Option(
                       "--url", help="a running balancer (with --direct); default: start two replicas and haproxy")] = None,
                   direct: Annotated[str | None, typer.Option(
                       "--direct", help="one replica behind --url, reached directly")] = None,
                   db: Annotated[str | None, typer.Option(
                       "--db", help="without --url: the PostgreSQL URL the two replicas share")] = None,
                   users: Annotated[str, typer.Option("--users", help="concurrent API conversations, e.g. 1,16")] = "1,16",
                   turns: int = 3,
                   rounds: Annotated[int, typer.Option(
                       "--rounds", help="rounds per target in ABBA order (balancer direct, direct balancer, ...)")] = 2,
                   max_new_tokens: Annotated[int, typer.Option("--max-new-tokens")] = 16,
                   probes: Annotated[int, typer.Option("--probes", help="GET /v1/models per target")] = 200,
                   as_json: JsonOpt = False) -> None:
    """The API through HAProxy before two replicas beside one replica directly: throughput, p95, added p50."""
    from isagi.bench.balancer import run

    _report(run(url, direct, db_url=db, users=tuple(_count_list(users, "--users")), turns=turns, rounds=rounds,
                max_new_tokens=max_new_tokens, probes=probes), as_json)


@bench_app.command("serve")
@friendly
def bench_serve(
    users: Annotated[str, typer.Option("--users", help="numbers of concurrent users, e.g. 1,8,16")] = "1,8,16",
    isagi_parallel: Annotated[str, typer.Option(
        "--isagi-parallel", help="ISAGI_PARALLEL settings of isagi serve, e.g. 1,8")] = "1,8",
    anchor_parallel: Annotated[str, typer.Option(
        "--anchor-parallel", help="llama-server's -np settings, e.g. 1,8 (paired with --isagi-parallel)")] = "1,8",
    threads: Annotated[int | None, typer.Option(
        "--threads", min=1, help="llama.cpp threads of both servers (default: ISAGI_THREADS, else every core)")] = None,
    turns: Annotated[int, typer.Option("--turns", min=1, help="turns per conversation")] = 4,
    duration: Annotated[float, typer.Option(
        "--duration", min=0, help="seconds each run lasts: users start new conversations until then "
                                  "(0: one conversation each)")] = 30.0,
    max_tokens: Annotated[int, typer.Option("--max-tokens", min=1, help="reply cap (greedy)")] = 32,
    rounds: Annotated[int, typer.Option("--rounds", min=1, help="runs per server, setting and number of users")] = 1,
    anchor: Annotated[Path | None, typer.Option(
        "--anchor", help="a built llama-server; default: build it from llama-cpp-python's source once (cached)")] = None,
    hog: Annotated[bool, typer.Option(
        "--hog", help="instead: 1 user, quiet and beside a one-core busy loop (the first setting of each)")] = False,
    deadline: Annotated[float, typer.Option("--deadline", help="seconds a turn may take before it is given up")] = 75.0,
    model: ModelOpt = None, home: HomeOpt = None, as_json: JsonOpt = False,
) -> None:
    """isagi serve beside llama.cpp's llama-server on the same GGUF and the same closed-loop load."""
    from isagi.bench.serve import Options, run, run_hog, table

    options = Options(users=tuple(_count_list(users, "--users")),
                      isagi_parallel=tuple(_count_list(isagi_parallel, "--isagi-parallel")),
                      anchor_parallel=tuple(_count_list(anchor_parallel, "--anchor-parallel")),
                      threads=threads, turns=turns, duration_s=duration or None, max_tokens=max_tokens, rounds=rounds,
                      anchor=anchor, deadline_s=deadline)
    settings = _settings(model=model, home=home)
    data = run_hog(settings, options) if hog else run(settings, options)
    if as_json:
        _print_json(data)
        return
    out.print(table(data))
    if not hog:
        check = data["prompt_check"]
        out.print(f"same prompt text: {check.get('same_prompt_text')}; same greedy reply: {check.get('same_reply')}",
                  highlight=False)


@bench_app.command("soak")
@friendly
def bench_soak(conversations: Annotated[int, typer.Option(min=1, help="one-off API conversations")] = 1500,
               page_sessions: Annotated[int, typer.Option(
                   min=0, max=31, help="one-question page chats first (they stay open: below the client's cap of 32)")] = 20,
               every: Annotated[int, typer.Option(min=1, help="read the server's RSS after every N")] = 100,
               idle_s: Annotated[float, typer.Option(min=0, help="seconds of no traffic before the last reading")] = 60.0,
               idle_minutes: Annotated[float | None, typer.Option(
                   help="the server's ISAGI_IDLE_MINUTES, e.g. 0.5 to read RSS after its sessions are evicted")] = None,
               home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """A live server flooded with page chats and one-off API conversations: its RSS as it goes and when idle."""
    from isagi.bench.soak import run

    _report(run(conversations=conversations, page_sessions=page_sessions, every=every, idle_s=idle_s,
                idle_minutes=idle_minutes, home=home), as_json)


@bench_app.command("attention")
@friendly
def bench_attention(model: ModelOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Decode time per token after 50 to 2,500 tokens of context, flash attention on and off (plain llama.cpp)."""
    from isagi.bench.attention import run

    _report(run(_settings(model=model, home=home)), as_json)


@bench_app.command("start")
@friendly
def bench_start(warm_repeats: Annotated[int, typer.Option("--warm-repeats")] = 2, as_json: JsonOpt = False) -> None:
    """Process start to a ready /health: cold (empty data directory) and warm."""
    from isagi.bench.start import run

    _report(run(warm_repeats=warm_repeats), as_json)


def _report(data: dict[str, Any], as_json: bool) -> None:
    if as_json:
        _print_json(data)
        return
    for key, value in data.items():
        out.print(f"[bold]{key:>24}[/]  {value}", highlight=False)


# -- evaluations -------------------------------------------------------------------


BENCHMARKS_HELP = ("directory holding advbench_harmful_behaviors.csv, xstest_prompts.csv and, to measure it too, "
                   "alpaca_seed_tasks.jsonl; default: the AdvBench and XSTest that ship with ISAGI (the Alpaca "
                   "seed tasks do not ship)")
BenchmarksOpt = Annotated[Path | None, typer.Option("--benchmarks", help=BENCHMARKS_HELP)]


@eval_app.command("tiers")
@friendly
def eval_tiers(pairs: Annotated[Path | None, typer.Option("--pairs", help="JSONL of {first, second, relation}")] = None,
               no_generate: Annotated[bool, typer.Option("--no-generate", help="store the first query with a placeholder reply")] = False,
               model: ModelOpt = None, backend: BackendOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Tier of the second query of each pair after a fresh session took the first."""
    from isagi.evals.tiers import run

    engine = _engine(_settings(model=model, backend=backend, home=home), with_store=False)
    _report(run(engine, pairs, generate=not no_generate), as_json)


@eval_app.command("safety")
@friendly
def eval_safety(harmful: Annotated[Path | None, typer.Option("--harmful")] = None,
                benign: Annotated[Path | None, typer.Option("--benign")] = None,
                benchmarks: BenchmarksOpt = None,
                method: Annotated[str, typer.Option("--method", help="isagi | seed")] = "isagi",
                replies: Annotated[bool, typer.Option(
                    "--replies", help="the reply guard instead: replies generated with the prompt guard off")] = False,
                limit: Annotated[int | None, typer.Option(
                    "--limit", min=1, help="with --replies: the first N prompts of each set")] = None,
                model: ModelOpt = None, backend: BackendOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """TPR/FPR per set at the shipped threshold and ROC AUC, out of sample (--replies: the reply guard)."""
    from isagi.evals.safety import run, run_replies

    settings = _settings(model=model, backend=backend, home=home)
    engine = _engine(settings, with_store=False)
    if replies:
        _report(run_replies(engine.lm, engine.profile.safety, system_prompt=settings.system_prompt,
                            benchmarks_dir=benchmarks, limit=limit, progress=_progress_printer()), as_json)
        return
    _report(run(engine.lm, engine.profile.safety, system_prompt=settings.system_prompt, benchmarks_dir=benchmarks,
                harmful=harmful, benign=benign, method=method), as_json)


def _count_list(text: str, option: str) -> list[int]:
    from isagi.errors import InputError

    try:
        counts = [int(x) for x in text.split(",") if x.strip()]
    except ValueError:
        counts = []
    if not counts or min(counts) < 0:
        raise InputError(f"{option} {text!r}: give whole numbers of 0 or more separated by commas, e.g. 10,100,1000.")
    return counts


def _layer_list(text: str, option: str) -> list[int]:
    from isagi.errors import InputError

    try:
        return [int(x) for x in text.split(",") if x.strip()]
    except ValueError as exc:
        raise InputError(f"{option} {text!r}: give decoder layer numbers separated by commas, e.g. 16,18,20.") from exc


@eval_app.command("safety-cv")
@friendly
def eval_safety_cv(sets: Annotated[list[str] | None, typer.Option(
                       "--layers", help="read-out layers side by side, e.g. 12,18 (repeatable: one setting each)")] = None,
                   probes: Annotated[list[str] | None, typer.Option(
                       "--probe", help="logistic:C or mlp:UNITS, e.g. logistic:0.03, mlp:8 (repeatable)")] = None,
                   model: ModelOpt = None, backend: BackendOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Cross-validation on the calibration corpus only (leave one source out, leave one category
    out, 5 folds with twin pairs whole): how the probe's layers and kind were chosen."""
    from isagi.errors import InputError
    from isagi.evals.safety_cv import run
    from isagi.safety.probe import ProbeSpec

    layer_sets = [_layer_list(x, "--layers") for x in sets or ["18", "6,12,18", "12,18,24"]]
    try:
        specs = [ProbeSpec.parse(x) for x in probes or ["logistic:0.03", "mlp:8"]]
    except ValueError as exc:
        raise InputError(f"--probe: {exc}") from exc
    from isagi.engines import load_engine

    settings = _settings(model=model, backend=backend, home=home)
    lm = load_engine(settings)  # no profile needed: this is what a profile's choices rest on
    _report(run(lm, system_prompt=settings.system_prompt, layer_sets=layer_sets, specs=specs,
                progress=_progress_printer()), as_json)


@eval_app.command("ogd")
@friendly
def eval_ogd(benchmarks: BenchmarksOpt = None, alpha: float = 0.15,
             model: ModelOpt = None, backend: BackendOpt = None, home: HomeOpt = None, as_json: JsonOpt = False) -> None:
    """Safe vs regular OGD exploration; refusals and perplexity with and without Q_f ablation."""
    from isagi.evals.ogd import pipeline_turn, run

    engine = _engine(_settings(model=model, backend=backend, home=home), with_store=False)
    _report(run(engine.lm, engine.profile.safety, alpha=alpha, benchmarks_dir=benchmarks,
                system_prompt=engine.settings.system_prompt, pipeline=pipeline_turn(engine)), as_json)


def main() -> None:
    """Console-script entry point."""
    app()


if __name__ == "__main__":
    main()
