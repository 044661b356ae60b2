"""Mapping between a live :class:`~isagi.session.state.Session` and a ``.miku`` v2 file.

Owns what a session file holds: the conversation (each
:class:`~isagi.session.turn.Turn` as its two message dicts), the metric M, the
trajectory memory as columns, and the session's own UGT basis (so a session
restores exactly even if the model's profile is recalibrated later). The file
format itself (validation, checksums, atomic writes) is ``storage.miku``'s;
what the values *mean* is checked here, in :func:`check_session_state`, before
anything is built from a file: finite float arrays of agreeing shapes, a
symmetric positive definite metric, sane scalars. A file that fails any check
raises one :class:`MikuError` naming the field, and nothing is loaded.

A session id from a file is never trusted: one that is missing or not of the
server's pattern (:func:`isagi.ids.is_session_id`) is replaced by a fresh one.

What a file records of the engine it was made with, and must match to load,
is a :class:`SessionFrame` (``Engine.frame``), not the engine: this module
sits below the turn pipeline. Also the import of a research-code miku-v1 pair
(:func:`import_legacy`): ``storage.miku.legacy`` reads it, this module completes it
with ISAGI's defaults into a session that resumes.
"""

from __future__ import annotations

import datetime as _dt
import math
import os
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from isagi import __version__
from isagi.errors import MikuError, StorageError
from isagi.ids import is_session_id, new_session_id
from isagi.manifold.cog import Metric
from isagi.manifold.memory import TrajectoryMemory
from isagi.manifold.sameness import content_key
from isagi.manifold.ugt import Basis
from isagi.session.state import Session
from isagi.session.turn import turns_from_messages, turns_to_messages
from isagi.session.versions import versions_from_extra, versions_to_extra
from isagi.storage.titles import session_title

if TYPE_CHECKING:
    from isagi.session.store import SessionStore
    from isagi.storage.fences import Fence
    from isagi.storage.miku import MikuState

FORMAT_VERSION = 2
SESSION_TENSORS = ("metric", "basis", "mu", "singular_values")
ROLES = frozenset({"user", "assistant", "system"})
# Bounds of a session's scalars: anything outside is damage, not a session.
MAX_METRIC_COUNT = 10**12  # metric version / updates / floor events
MAX_METRIC_WINDOW = 10**7
MAX_ETA = 1e6  # eta and eig_floor: finite, > 0, at most this
MAX_TIMESTAMP = 1e11  # seconds since 1970 (the year 5138)
MAX_TITLE_CHARS = 1000
# |M[i, j]| at most: M grows by at most eta (in Frobenius norm) per update, so
# no session comes near; beyond it the metric's arithmetic would overflow.
MAX_METRIC_ENTRY = 1e12
# Largest magnitude of the state's other arrays. A basis has unit columns (entries at most 1),
# a model's hidden states (mu) stay within a few thousand, coordinates within what they give;
# values near float32's end (3e38) load but make every later turn's arithmetic overflow (NaN).
MAX_BASIS_ENTRY = 1e3
MAX_STATE_ENTRY = 1e9  # mu, singular values, trajectory coordinates
# |M - M^T| <= SYMMETRY_RTOL * max|M| + SYMMETRY_ATOL (Metric keeps M exactly symmetric)
SYMMETRY_RTOL = 1e-8
SYMMETRY_ATOL = 1e-12


@dataclass(frozen=True)
class SessionFrame:
    """What a session file records of the engine it was made with, and what a file must
    match to be loaded (``Engine.frame`` makes it): the file needs no more of the engine."""

    model_id: str
    model_fingerprint: str
    hidden_size: int  # d: a file of another d cannot be loaded
    layer: int  # the profile's hidden-state layer
    profile_key: str
    system_prompt: str


def _bad(where: str, field: str, what: str) -> MikuError:
    return MikuError(f"{where}: {field} {what}; the file is damaged or not an ISAGI session.")


def _float_array(where: str, field: str, arr: object, shape: tuple[int, ...],
                 bound: float = MAX_STATE_ENTRY) -> np.ndarray:
    if not isinstance(arr, np.ndarray):
        raise _bad(where, field, "is missing or not an array")
    if arr.dtype.kind != "f" or arr.dtype.itemsize < 4:
        raise _bad(where, field, f"has dtype {arr.dtype}, expected float32 or float64")
    if arr.shape != shape:
        raise _bad(where, field, f"has shape {list(arr.shape)}, expected {list(shape)}")
    if not np.isfinite(arr).all():
        raise _bad(where, field, "holds NaN or infinite values")
    if arr.size and float(np.abs(arr).max()) > bound:
        raise _bad(where, field, f"holds a value beyond {bound:g}")
    return arr


def _int_array(where: str, field: str, arr: object, n: int, lo: int) -> np.ndarray:
    if not isinstance(arr, np.ndarray) or arr.dtype.kind not in "iu":
        raise _bad(where, field, "is missing or not an integer array")
    if arr.shape != (n,):
        raise _bad(where, field, f"has shape {list(arr.shape)}, expected [{n}]")
    if n and int(arr.min()) < lo:
        raise _bad(where, field, f"holds a value below {lo}")
    return arr


def _number(where: str, field: str, v: object, lo: float, hi: float, *, whole: bool) -> float:
    if isinstance(v, int | float) and not isinstance(v, bool) and _within(v, lo, hi, whole=whole):
        return float(v)
    kind = "a whole number" if whole else "a finite number"
    raise _bad(where, field, f"= {str(v)[:40]} is not {kind} in [{lo:g}, {hi:g}]")


def _within(v: int | float, lo: float, hi: float, *, whole: bool) -> bool:
    if whole and not (isinstance(v, int) or (math.isfinite(v) and v == int(v))):
        return False
    try:
        return math.isfinite(float(v)) and lo <= v <= hi
    except OverflowError:
        return False


def check_session_state(state: MikuState, where: str | os.PathLike[str] = "session") -> None:
    """Raise :class:`MikuError` naming the field unless ``state`` is a loadable session.

    Checks the session tensors (present, float32/64, finite, shapes agreeing
    with the header's d and k), the metric (symmetric, Cholesky succeeds), the
    trajectory columns (shapes, dtypes, finite coordinates), the metric's
    scalars and the messages' roles. Builds nothing.
    """
    where = str(where)
    header, tensors, extra, traj = state.header, state.tensors, state.extra, state.trajectories
    d, k = int(header["d"]), int(header["k"])
    for name in SESSION_TENSORS:
        if name not in tensors:
            raise MikuError(f"{where}: the session file has no {name!r} tensor; it is not an ISAGI session.")
    if k > d:
        raise _bad(where, "header k", f"= {k} is larger than d = {d}")
    _float_array(where, "basis", tensors["basis"], (d, k), MAX_BASIS_ENTRY)
    _float_array(where, "mu", tensors["mu"], (d,))
    sv = _float_array(where, "singular_values", tensors["singular_values"], (k,))
    if k and float(sv.min()) < 0:
        raise _bad(where, "singular_values", "holds a negative value")
    m = _float_array(where, "metric", tensors["metric"], (k, k), math.inf).astype(np.float64)
    if float(np.abs(m).max()) > MAX_METRIC_ENTRY:
        raise _bad(where, "metric", f"has an entry beyond {MAX_METRIC_ENTRY:g}")
    if not np.allclose(m, m.T, rtol=0.0, atol=SYMMETRY_RTOL * float(np.abs(m).max()) + SYMMETRY_ATOL):
        raise _bad(where, "metric", "is not symmetric")
    try:
        np.linalg.cholesky(0.5 * (m + m.T))
    except np.linalg.LinAlgError:
        raise _bad(where, "metric", "is not positive definite") from None

    ms = extra.get("metric", {})
    if not isinstance(ms, dict):
        raise _bad(where, "extra.metric", "is not a map")
    if "k" in ms:
        _number(where, "metric k", ms["k"], k, k, whole=True)
    for key in ("eta", "eig_floor"):
        if key in ms:
            v = _number(where, f"metric {key}", ms[key], 0.0, MAX_ETA, whole=False)
            if v <= 0:
                raise _bad(where, f"metric {key}", "must be greater than 0")
    counts = {
        key: _number(where, f"metric {key}", ms.get(key, 0), 0, MAX_METRIC_COUNT, whole=True)
        for key in ("version", "updates", "floor_events")
    }
    if not counts["floor_events"] <= counts["updates"] <= counts["version"]:
        raise _bad(where, "metric counts", "are inconsistent (floor_events <= updates <= version)")
    if "window" in ms:
        _number(where, "metric window", ms["window"], 0, MAX_METRIC_WINDOW, whole=True)
    if "basis_explained" in extra:
        _number(where, "basis_explained", extra["basis_explained"], 0.0, 1.0, whole=False)
    if "created" in extra:
        _number(where, "created", extra["created"], 0.0, MAX_TIMESTAMP, whole=False)
    title = extra.get("title")
    if title is not None and (not isinstance(title, str) or len(title) > MAX_TITLE_CHARS):
        raise _bad(where, "title", f"must be a string of at most {MAX_TITLE_CHARS} characters")

    if traj:
        n = state.n_trajectories
        for name in ("query_x", "reply_x"):
            _float_array(where, f"trajectories {name}", traj.get(name), (n, k))
        for name in ("created", "last_hit"):
            arr = _float_array(where, f"trajectories {name}", traj.get(name), (n,), MAX_TIMESTAMP)
            if n and (float(arr.min()) < 0 or float(arr.max()) > MAX_TIMESTAMP):
                raise _bad(where, f"trajectories {name}", "holds a time out of range")
        _int_array(where, "trajectories id", traj.get("id"), n, 0)
        _int_array(where, "trajectories cluster", traj.get("cluster"), n, -1)
        _int_array(where, "trajectories hits", traj.get("hits"), n, 0)
    for i, msg in enumerate(state.conversation):
        if msg["role"] not in ROLES:
            raise _bad(where, f"message {i}", f"has role {msg['role'][:20]!r}, not one of {sorted(ROLES)}")


def _created(header: dict[str, Any], extra: dict[str, Any]) -> float:
    """The session's creation time: exact from extra, else the header's ISO time."""
    if isinstance(extra.get("created"), int | float):
        return float(extra["created"])
    t = _dt.datetime.fromisoformat(header["created"])  # checked by the reader
    if t.tzinfo is None:
        t = t.replace(tzinfo=_dt.UTC)
    return t.timestamp()


def session_state(frame: SessionFrame, session: Session) -> MikuState:
    """The session as a :class:`storage.miku.MikuState`."""
    from isagi.storage.miku import MikuState

    b = session.basis
    metric_state = session.metric.to_state()
    tensors: dict[str, np.ndarray] = {
        "metric": np.asarray(session.metric.M, dtype=np.float64),
        "basis": np.asarray(b.B, dtype=np.float32),
        "mu": np.asarray(b.mu, dtype=np.float32),
        "singular_values": np.asarray(b.singular_values, dtype=np.float32),
    }
    extra: dict[str, Any] = {
        "session_id": session.id,
        "created": float(session.created),  # exact; the header holds it to the second
        "title": session.title or "",
        # Whose it is, for the start-up repair of a history row a kill left unwritten
        # (isagi.pipeline.keeping.reconcile_history); never read back into a live session.
        "owner": session.owner,
        "profile_key": frame.profile_key,
        "basis_explained": float(b.explained),
        "metric": {k: v for k, v in metric_state.items() if not isinstance(v, np.ndarray)},
        "system_prompt": frame.system_prompt,
    }
    if session.versions:
        extra["reply_versions"] = versions_to_extra(session.versions)
    header = {
        "format_version": FORMAT_VERSION,
        "created": _dt.datetime.fromtimestamp(session.created, _dt.UTC).isoformat(timespec="seconds"),
        "isagi_version": __version__,
        "model_id": frame.model_id,
        "model_fingerprint": frame.model_fingerprint,
        "d": int(b.B.shape[0]),
        "k": int(b.B.shape[1]),
        "layer": int(frame.layer),
    }
    conversation = turns_to_messages(session.turns)
    return MikuState(
        header=header,
        tensors=tensors,
        trajectories=session.memory.to_columns(),
        conversation=conversation,
        extra=extra,
    )


def save_session(frame: SessionFrame, session: Session, path: Path, *, files: SessionStore | None = None) -> None:
    """Write the session atomically to ``path`` (parent directories are created), in ``files``
    (the session store: :mod:`isagi.session.store`; None, a local file).

    What :func:`load_session` would refuse is not written: the state passes the
    same :func:`check_session_state` first (the format's own limits are the
    writer's, :func:`storage.miku.write_miku`), and the file already there stays.
    """
    from isagi.storage.miku import write_miku

    state = session_state(frame, session)
    check_session_state(state, "the session")
    if files is not None:
        files.write(path, state, fence=session.lease)  # a shared store: only while its lease is current
        return
    path.parent.mkdir(parents=True, exist_ok=True)
    write_miku(path, state)


def retitle_file(path: Path, title: str, *, files: SessionStore | None = None, fence: Fence | None = None) -> None:
    """Give the session saved at ``path`` (in ``files``; None: a local file) the title ``title``
    (its settings' ``title``), rewriting the file atomically; the rest of the file is kept as it
    is. Needs no model: a renamed session's file is read and written as the format's state, not
    as a living session. ``fence``: the lease held on it meanwhile (a shared store)."""
    from isagi.storage.miku import read_miku, write_miku

    state = files.read(path, allow_other_model=True) if files is not None else read_miku(path, allow_other_model=True)
    state.extra["title"] = title
    check_session_state(state, path)
    if files is not None:
        files.write(path, state, fence=fence)
    else:
        write_miku(path, state)


def load_session(
    frame: SessionFrame,
    path: Path,
    *,
    allow_other_model: bool = False,
    id_taken: Callable[[str], bool] | None = None,
    session_id: str | None = None,
    files: SessionStore | None = None,
) -> Session:
    """Restore a session from ``path`` (in ``files``; None: a local file); raise :class:`MikuError` if it does not fit ``frame``
    (another model, unless ``allow_other_model``; another hidden size).

    Everything is checked (:func:`session_from_state`) before the session is
    used. A session id in the file that is missing, malformed, or for which
    ``id_taken`` answers True (another live or stored session has it) is
    replaced by a fresh :func:`~isagi.ids.new_session_id`; the file's own id
    is then kept nowhere. ``session_id``: open it as that session instead (the
    caller knows the file as that session's autosave, e.g. from the history).
    """
    from isagi.storage.miku import read_miku

    if files is not None:
        state = files.read(path, expected_fingerprint=frame.model_fingerprint, allow_other_model=allow_other_model)
    else:
        state = read_miku(
            path, expected_fingerprint=frame.model_fingerprint, allow_other_model=allow_other_model
        )
    d = int(state.header["d"])
    if d != frame.hidden_size:
        raise MikuError(
            f"{path}: the session was made with hidden size {d}, this model has "
            f"{frame.hidden_size}; load it with the model it was saved with."
        )
    return session_from_state(state, path, id_taken=id_taken, session_id=session_id)


def session_from_state(
    state: MikuState,
    where: str | Path = "session",
    *,
    id_taken: Callable[[str], bool] | None = None,
    session_id: str | None = None,
) -> Session:
    """The :class:`Session` a read file holds, or :class:`MikuError` saying why it would not load.

    The one judgement of a file: :func:`load_session` and ``isagi inspect`` both end here, so a
    file inspect passes is one the loader takes. Checks (:func:`check_session_state`), then builds
    the basis, the metric, the memory and the turns; anything a check did not foresee that the
    building refuses is a :class:`MikuError` too. ``id_taken`` and ``session_id``: as in
    :func:`load_session`.
    """
    check_session_state(state, where)
    header, tensors, extra = state.header, state.tensors, state.extra
    k = int(header["k"])
    try:
        basis = Basis(
            B=tensors["basis"].astype(np.float32, copy=False),
            mu=tensors["mu"].astype(np.float32, copy=False),
            singular_values=tensors["singular_values"].astype(np.float32, copy=False),
            explained=float(extra.get("basis_explained", 0.0)),
        )
        defaults = Metric(k)  # what a file that leaves them out (an import) gets
        metric_state: dict[str, Any] = {"k": k, "eta": defaults.eta, "eig_floor": defaults.eig_floor}
        metric_state.update(extra.get("metric", {}))
        metric_state["M"] = tensors["metric"]
        metric = Metric.from_state(metric_state)
        memory = TrajectoryMemory.from_columns(state.trajectories, k)
        turns = turns_from_messages(state.conversation)
        versions = versions_from_extra(extra.get("reply_versions"), turns)
        created = _created(header, extra)
    except (KeyError, ValueError, TypeError, OverflowError, AttributeError) as exc:
        raise MikuError(f"{where}: the session's contents are inconsistent ({exc}); "
                        "it cannot be loaded, keep it only as a record.") from None
    if session_id is not None:
        sid = session_id
    else:
        found = extra.get("session_id")
        sid = found if is_session_id(found) and not (id_taken is not None and id_taken(found)) else new_session_id()
    title = extra.get("title") or None
    return Session(
        id=sid,
        basis=basis,
        metric=metric,
        memory=memory,
        turns=turns,
        created=created,
        title=title,
        versions=versions,
    )


def import_legacy(
    old_path: str | os.PathLike[str],
    new_path: str | os.PathLike[str],
    *,
    model_fingerprint: str | None = None,
    layer: int | None = None,
) -> MikuState:
    """Convert a v1 pair at ``old_path`` into a v2 file at ``new_path``.

    Refuses to overwrite the v1 JSON itself (``new_path == old_path``), since
    the v1 pair would then be lost if anything went wrong.
    """
    from isagi.storage.miku import write_miku
    from isagi.storage.miku.legacy import read_legacy

    old, new = Path(old_path), Path(new_path)
    if old.resolve() == new.resolve():
        raise StorageError(
            f"Refusing to overwrite the legacy file {old} in place; choose another output path."
        )
    state = resumable(read_legacy(old, model_fingerprint=model_fingerprint, layer=layer), old)
    write_miku(new, state)
    return state


def resumable(state: MikuState, where: str | os.PathLike[str] = "legacy session") -> MikuState:
    """Complete an imported v1 state into a session ``load_session`` resumes.

    v1 never stored what ISAGI's sessions also hold; the importer fills it in
    with what is known: the singular values of the basis (unknown: zeros, and
    an explained share of 0), ``mu`` (zeros when absent), the reply
    coordinates (zeros when absent), the trajectories' content keys (computed
    from the queries, as the agent does) and context keys (none), the metric's
    settings (ISAGI's defaults, counts 0) and a title (the first question).
    No session id: the session gets a fresh one when it is loaded. The result
    is checked as a loaded session is, so a pair that imports also resumes.
    """
    header, tensors, traj = state.header, state.tensors, state.trajectories
    d, k, n = header["d"], header["k"], state.n_trajectories
    tensors.setdefault("mu", np.zeros(d, np.float32))
    tensors.setdefault("singular_values", np.zeros(k, np.float32))
    try:
        metric = Metric(k, M=tensors["metric"])
    except ValueError as exc:
        raise MikuError(f"{where}: the metric cannot be used ({exc}).") from None
    if n or "query_x" in traj:
        traj.setdefault("reply_x", np.zeros((n, k), np.float32))
        traj.setdefault("context_key", [""] * n)
        traj.setdefault("content_key", [content_key(q) for q in traj["query_text"]])
    state.extra["metric"] = {
        key: value for key, value in metric.to_state().items() if not isinstance(value, np.ndarray)
    }
    state.extra.setdefault("basis_explained", 0.0)
    first = next((m["text"] for m in state.conversation if m["role"] == "user"), "")
    state.extra.setdefault("title", session_title(None, first) if first.strip() else "")  # none: untitled, as before
    check_session_state(state, where)
    return state
