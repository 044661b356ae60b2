"""Reading the research code's miku-v1 session pair as a ``.miku`` v2 state.

The research code saved a session as two files and loaded the second one with
full unpickling, so a shared session file could run code on the reader's
machine. This module reads that pair safely (JSON with size and type checks;
the tensor file only through ``torch.load(weights_only=True)``, which refuses
any pickled object that is not a plain tensor container) and converts it to
:class:`storage.miku.MikuState`. ``write_legacy`` produces the same pair, for
tests and for the ``isagi bench miku`` comparison. Completing the state into a
session ISAGI resumes (its metric settings, content keys, title) is domain
knowledge and lives in :func:`isagi.session.files.import_legacy`, which writes
the v2 file.

The research code itself is not available; the v1 layout below is the one we
reconstructed from its documentation and is what this module reads and writes.

``NAME.miku`` (UTF-8 JSON object)::

    {
      "version": "1.0",                   # "1.x"
      "model": "HuggingFaceTB/SmolLM2-135M-Instruct",
      "created": "2025-03-01T12:00:00",   # ISO-8601
      "layer": 18,                        # optional: hidden-state layer
      "metric_growth": 0.42,              # optional: ||M - I||_F when saved
      "settings": {...},                  # optional: JSON-like dict
      "conversation": [                   # chat log, in order
        {"role": "user" | "assistant" | "system", "content": str,
         "timestamp": float (optional)}
      ],
      "trajectories": [                   # one per remembered exchange, row i
        {"query": str, "response": str, "tier": str,
         "timestamp": float, "hits": int (optional), "cluster": int (optional),
         "last_hit": float (optional)}
      ]
    }

``NAME.miku.pt`` (``torch.save`` of a dict of tensors)::

    {"metric": (k, k), "basis": (d, k), "mu": (d,) optional,
     "trajectory_coords": (N, k)  query coordinates, row i = trajectories[i],
     "response_coords": (N, k) optional reply coordinates}

Mapping to v2: ``metric``/``basis``/``mu`` become tensors (metric float64,
basis and mu float32); trajectory rows become the columns ``id``, ``query_x``,
``reply_x`` (when present), ``query_text``, ``reply_text``, ``tier``,
``cluster``, ``created``, ``last_hit``, ``hits``; messages become
``{"role", "text", "created"?}``; ``settings`` and ``metric_growth`` go into
``extra`` (under ``"legacy"``). v1 has no model fingerprint, so the importer
takes one as an argument.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
import warnings
from pathlib import Path
from typing import Any

import numpy as np

from isagi.errors import MikuError, StorageError
from isagi.storage.miku.limits import MAX_MIKU_BYTES
from isagi.storage.miku.state import MikuState, new_header
from isagi.storage.miku.validate import _check_extra

LEGACY_UNKNOWN_FINGERPRINT = "legacy-v1-unknown"
# Each file of the pair: a 10,000-turn session's pair is ~16 MB in all.
MAX_LEGACY_BYTES = MAX_MIKU_BYTES
# JSON objects and arrays in the JSON file, counted (over-counted: brackets in
# texts count too) before parsing: parsing ~3 bytes of "{}," makes a ~100-byte
# dict, so the count, not the size, bounds the memory. A 10,000-turn session
# has ~30,000.
MAX_LEGACY_CONTAINERS = 400_000
# Sane ranges of v1 numbers (anything else is damage, not a session).
_MAX_TIMESTAMP = 1e11  # seconds since 1970: the year 5138
_MAX_COUNT = 2**31 - 1  # hits and cluster ids are stored as int32
# torch dtypes a tensor file may hold; anything else (float8, complex, ...) is refused
_FLOAT_DTYPES = ("float16", "bfloat16", "float32", "float64")
_FLOAT32_MAX = float(np.finfo(np.float32).max)
_KNOWN_TENSORS = frozenset({"metric", "basis", "mu", "trajectory_coords", "response_coords"})


def tensor_path(json_path: str | os.PathLike[str]) -> Path:
    """The ``.pt`` companion of a v1 ``.miku`` JSON file (``NAME.miku.pt``)."""
    p = Path(json_path)
    return p.with_name(p.name + ".pt")


def _bad(path: Path, what: str) -> MikuError:
    return MikuError(f"{path} is not a valid legacy v1 session: {what}")


def _refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a number a session can hold")


def _finite_float(text: str) -> float:
    value = float(text)
    if not math.isfinite(value):
        raise ValueError(f"{text[:40]} is out of the range of a float")
    return value


def _load_json(path: Path) -> dict[str, Any]:
    try:
        size = path.stat().st_size
        if size > MAX_LEGACY_BYTES:
            raise _bad(path, f"{size} bytes is larger than the limit of {MAX_LEGACY_BYTES}")
        raw = path.read_bytes()
        if raw.count(b"{") + raw.count(b"[") > MAX_LEGACY_CONTAINERS:
            raise _bad(path, f"more than {MAX_LEGACY_CONTAINERS} JSON objects and arrays")
        doc = json.loads(
            raw.decode("utf-8"), parse_constant=_refuse_constant, parse_float=_finite_float
        )
    except FileNotFoundError:
        raise MikuError(f"{path} does not exist") from None
    except MikuError:
        raise
    except (UnicodeDecodeError, json.JSONDecodeError, RecursionError, ValueError) as exc:
        raise _bad(path, f"not UTF-8 JSON ({type(exc).__name__}: {str(exc)[:160]})") from None
    except OSError as exc:
        raise MikuError(f"{path} cannot be read: {exc.strerror or exc}") from None
    if not isinstance(doc, dict):
        raise _bad(path, "the top level must be a JSON object")
    version = doc.get("version")
    if not isinstance(version, str) or not version.startswith("1."):
        raise _bad(path, f"version {str(version)[:20]!r} is not 1.x")
    return doc


def _load_tensors(path: Path) -> dict[str, np.ndarray]:
    import pickle

    import torch

    if not path.is_file():
        raise MikuError(f"{path} (the tensor file of the legacy session) does not exist")
    if path.stat().st_size > MAX_LEGACY_BYTES:
        raise _bad(path, "tensor file is too large")
    try:
        # weights_only=True: a restricted unpickler that only rebuilds tensors
        # and plain containers; any other pickled object is refused, never run.
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", UserWarning)  # pickle-protocol chatter
            obj = torch.load(path, map_location="cpu", weights_only=True)
    except (pickle.UnpicklingError, RuntimeError, EOFError, ValueError, TypeError, OSError) as exc:
        lines = [ln.strip() for ln in str(exc).splitlines() if ln.strip()]
        # torch's message suggests weights_only=False; show only the reason.
        why = next((ln for ln in lines if "Unsupported" in ln or "GLOBAL" in ln), None)
        first = (why or (lines[0] if lines else type(exc).__name__))[:200]
        if "weights_only" in first:
            first = "it contains pickled objects other than tensors"
        raise MikuError(
            f"{path} was refused: it is not a plain tensor file ({first}). "
            "Legacy tensor files are loaded without running any code they contain."
        ) from None
    except Exception as exc:  # any other failure of the restricted loader
        raise MikuError(f"{path} was refused: {type(exc).__name__}: {str(exc)[:200]}") from None
    if not isinstance(obj, dict):
        raise _bad(path, f"tensor file holds a {type(obj).__name__}, expected a dict of tensors")
    out: dict[str, np.ndarray] = {}
    for name, t in obj.items():
        if not isinstance(name, str) or not isinstance(t, torch.Tensor):
            raise _bad(path, f"entry {str(name)[:40]!r} is not a named tensor")
        if name not in _KNOWN_TENSORS:
            continue  # nothing of v1 but the known tensors is imported
        dtype = str(t.dtype).removeprefix("torch.")
        if t.is_quantized or t.is_sparse or dtype not in _FLOAT_DTYPES:
            raise _bad(
                path,
                f"tensor {name[:40]!r} has dtype {dtype}; a session's tensors are floating point "
                f"({', '.join(_FLOAT_DTYPES)})",
            )
        if t.dim() > 2:
            raise _bad(path, f"tensor {name[:40]!r} has {t.dim()} dimensions, at most 2")
        t = t.detach().cpu()
        if t.dtype in (torch.bfloat16, torch.float16):
            t = t.to(torch.float32)
        arr = t.contiguous().numpy()
        if not np.isfinite(arr).all():
            raise _bad(path, f"tensor {name[:40]!r} holds NaN or infinite values")
        # all but the metric are stored as float32
        if name != "metric" and arr.size and float(np.abs(arr).max()) > _FLOAT32_MAX:
            raise _bad(path, f"tensor {name[:40]!r} holds values beyond the range of float32")
        out[name] = arr
    return out


def _num(
    path: Path,
    where: str,
    v: Any,
    default: float | None = None,
    *,
    lo: float = -_MAX_TIMESTAMP,
    hi: float = _MAX_TIMESTAMP,
) -> float:
    """``v`` as a finite float in ``[lo, hi]`` (``default`` when absent)."""
    if v is None and default is not None:
        return default
    if isinstance(v, bool) or not isinstance(v, int | float):
        raise _bad(path, f"{where} must be a number")
    try:
        f = float(v)
    except OverflowError:  # an int beyond any float (10**400)
        f = math.inf
    if not (math.isfinite(f) and lo <= f <= hi):
        raise _bad(path, f"{where} = {str(v)[:40]} is out of range ({lo:g} to {hi:g})")
    return f


def _count(path: Path, where: str, v: Any, default: int, lo: int) -> int:
    """``v`` as an integer in ``[lo, 2**31 - 1]`` (``default`` when absent)."""
    f = _num(path, where, v, float(default), lo=lo, hi=_MAX_COUNT)
    if f != int(f):
        raise _bad(path, f"{where} = {str(v)[:40]} is not a whole number")
    return int(f)


def read_legacy(
    json_path: str | os.PathLike[str],
    *,
    model_fingerprint: str | None = None,
    layer: int | None = None,
) -> MikuState:
    """Read a v1 pair (``NAME.miku`` + ``NAME.miku.pt``) into a v2 state.

    ``model_fingerprint`` fills the header field v1 never stored (default
    ``"legacy-v1-unknown"``); ``layer`` is used when the JSON has none
    (otherwise -1, meaning unknown). Raises :class:`MikuError` on anything
    malformed, including a tensor file that holds arbitrary pickled objects.
    """
    path = Path(json_path)
    doc = _load_json(path)
    tensors = _load_tensors(tensor_path(path))

    model = doc.get("model")
    if not isinstance(model, str) or not model:
        raise _bad(path, "'model' must be a non-empty string")
    created = doc.get("created")
    if created is None:
        created = _dt.datetime.fromtimestamp(path.stat().st_mtime, _dt.UTC).isoformat(
            timespec="seconds"
        )
    if not isinstance(created, str):
        raise _bad(path, "'created' must be a string")
    try:
        _dt.datetime.fromisoformat(created)
    except ValueError:
        raise _bad(path, f"'created' {created[:40]!r} is not an ISO-8601 time") from None
    json_layer = doc.get("layer", layer if layer is not None else -1)
    if not isinstance(json_layer, int) or isinstance(json_layer, bool):
        raise _bad(path, "'layer' must be an integer")
    if not -10_000 <= json_layer <= 10_000:
        raise _bad(path, f"'layer' = {str(json_layer)[:40]} is out of range")

    for name in ("metric", "basis", "trajectory_coords"):
        if name not in tensors:
            raise _bad(path, f"the tensor file has no {name!r}")
    basis = tensors["basis"]
    metric = tensors["metric"]
    if basis.ndim != 2 or metric.shape != (basis.shape[1], basis.shape[1]):
        raise _bad(
            path,
            f"basis {list(basis.shape)} and metric {list(metric.shape)} do not fit (d,k)/(k,k)",
        )
    d, k = basis.shape
    out_tensors: dict[str, np.ndarray] = {"metric": metric.astype(np.float64), "basis": basis.astype(np.float32)}
    if "mu" in tensors:
        if tensors["mu"].shape != (d,):
            raise _bad(path, f"mu has shape {list(tensors['mu'].shape)}, expected [{d}]")
        out_tensors["mu"] = tensors["mu"].astype(np.float32)

    rows = doc.get("trajectories", [])
    if not isinstance(rows, list):
        raise _bad(path, "'trajectories' must be a list")
    n = len(rows)
    q_x = tensors["trajectory_coords"]
    if q_x.shape != (n, k):
        raise _bad(path, f"trajectory_coords has shape {list(q_x.shape)}, expected [{n}, {k}]")
    query_text: list[str] = []
    reply_text: list[str] = []
    tier: list[str] = []
    created_t = np.empty(n, np.float64)
    last_hit = np.empty(n, np.float64)
    hits = np.empty(n, np.int32)
    cluster = np.empty(n, np.int32)
    for i, row in enumerate(rows):
        where = f"trajectories[{i}]"
        if not isinstance(row, dict):
            raise _bad(path, f"{where} must be an object")
        for key, dest in (("query", query_text), ("response", reply_text), ("tier", tier)):
            v = row.get(key, "" if key == "tier" else None)
            if not isinstance(v, str):
                raise _bad(path, f"{where}.{key} must be a string")
            dest.append(v)
        created_t[i] = _num(path, f"{where}.timestamp", row.get("timestamp"), 0.0, lo=0.0)
        last_hit[i] = _num(path, f"{where}.last_hit", row.get("last_hit"), created_t[i], lo=0.0)
        hits[i] = _count(path, f"{where}.hits", row.get("hits"), 0, lo=0)
        cluster[i] = _count(path, f"{where}.cluster", row.get("cluster"), -1, lo=-1)
    trajectories: dict[str, np.ndarray | list[str]] = {
        "id": np.arange(n, dtype=np.int64),
        "query_x": q_x.astype(np.float32),
    }
    if "response_coords" in tensors:
        r_x = tensors["response_coords"]
        if r_x.shape != (n, k):
            raise _bad(path, f"response_coords has shape {list(r_x.shape)}, expected [{n}, {k}]")
        trajectories["reply_x"] = r_x.astype(np.float32)
    trajectories.update(
        query_text=query_text,
        reply_text=reply_text,
        tier=tier,
        cluster=cluster,
        created=created_t,
        last_hit=last_hit,
        hits=hits,
    )

    conv_in = doc.get("conversation", [])
    if not isinstance(conv_in, list):
        raise _bad(path, "'conversation' must be a list")
    conversation = []
    for i, m in enumerate(conv_in):
        if not isinstance(m, dict) or not isinstance(m.get("role"), str):
            raise _bad(path, f"conversation[{i}] must be an object with a string role")
        text = m.get("content", m.get("text"))
        if not isinstance(text, str):
            raise _bad(path, f"conversation[{i}].content must be a string")
        msg: dict[str, Any] = {"role": m["role"], "text": text}
        if m.get("timestamp") is not None:
            msg["created"] = _num(path, f"conversation[{i}].timestamp", m["timestamp"], lo=0.0)
        conversation.append(msg)

    legacy_extra: dict[str, Any] = {"version": doc["version"]}
    if doc.get("metric_growth") is not None:
        legacy_extra["metric_growth"] = _num(
            path, "metric_growth", doc["metric_growth"], lo=0.0, hi=1e300
        )
    settings = doc.get("settings", {})
    if not isinstance(settings, dict):
        raise _bad(path, "'settings' must be an object")
    try:
        _check_extra(settings, "settings")
    except MikuError as exc:
        raise _bad(path, str(exc)) from None
    header = new_header(
        model_id=model,
        model_fingerprint=model_fingerprint or LEGACY_UNKNOWN_FINGERPRINT,
        d=int(d),
        k=int(k),
        layer=json_layer,
        imported_from="miku-v1",
    )
    header["created"] = created
    return MikuState(
        header=header,
        tensors=out_tensors,
        trajectories=trajectories,
        conversation=conversation,
        extra={"settings": settings, "legacy": legacy_extra},
    )


def write_legacy(path: str | os.PathLike[str], state: MikuState) -> None:
    """Write ``state`` as a v1 pair (JSON + ``torch.save``), like the research code.

    Used by tests and by the benchmark; not atomic, on purpose: it mirrors the
    old writer.
    """
    import torch

    path = Path(path)
    tr = state.trajectories
    n = state.n_trajectories

    def col(name: str, default: Any) -> list[Any]:
        c = tr.get(name)
        if c is None:
            return [default] * n
        return c.tolist() if isinstance(c, np.ndarray) else list(c)

    queries, replies, tiers = col("query_text", ""), col("reply_text", ""), col("tier", "")
    created, last_hit = col("created", 0.0), col("last_hit", 0.0)
    hits, cluster = col("hits", 0), col("cluster", -1)
    doc = {
        "version": "1.0",
        "model": state.header["model_id"],
        "created": state.header["created"],
        "layer": state.header["layer"],
        "settings": state.extra.get("settings", {}),
        "conversation": [
            {"role": m["role"], "content": m["text"], "timestamp": m.get("created")}
            for m in state.conversation
        ],
        "trajectories": [
            {
                "query": queries[i],
                "response": replies[i],
                "tier": tiers[i],
                "timestamp": created[i],
                "last_hit": last_hit[i],
                "hits": hits[i],
                "cluster": cluster[i],
            }
            for i in range(n)
        ],
    }
    metric = state.tensors.get("metric")
    if metric is not None:
        doc["metric_growth"] = float(np.linalg.norm(metric - np.eye(metric.shape[0]), "fro"))
    blobs = {name: torch.from_numpy(np.ascontiguousarray(a)) for name, a in state.tensors.items()}
    if "query_x" in tr:
        blobs["trajectory_coords"] = torch.from_numpy(np.ascontiguousarray(tr["query_x"]))
    if "reply_x" in tr:
        blobs["response_coords"] = torch.from_numpy(np.ascontiguousarray(tr["reply_x"]))
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        path.write_text(json.dumps(doc, ensure_ascii=False), encoding="utf-8")
        torch.save(blobs, tensor_path(path))
    except OSError as exc:
        raise StorageError(
            f"Could not write the legacy session {path}: {exc.strerror or exc}"
        ) from exc
