"""The per-model profile: calibration that every session of one model shares.

Owns computing, caching and loading what ISAGI measures once per
(model fingerprint, quantisation, layer, k, system prompt, corpus): the UGT
basis and its centre, the zone centroids, the forbidden subspace with its TEH
threshold and ROC curve, and the context-dependence threshold of the turn
pipeline. Profiles live under ``$ISAGI_HOME/profiles/<key>/`` as a JSON file
plus an ``.npz`` of arrays (read with ``allow_pickle=False``); a changed model,
layer, k, system prompt or corpus gives a new key, so a stale profile is never
used.
"""

from __future__ import annotations

import ast
import hashlib
import json
import os
import shutil
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np

from isagi import __version__
from isagi.errors import ProfileError
from isagi.manifold.distance_scale import DistanceScale
from isagi.manifold.ugt import Basis, Zones, fit_basis, fit_zones, project, refine_basis

PROFILE_VERSION = 2
Progress = Callable[[str, int, int], None]  # (stage, done, total)


@dataclass
class Profile:
    """Everything calibrated once per model (see the module docstring)."""

    key: str
    model_fingerprint: str
    layer: int
    k: int
    basis: Basis
    zones: Zones
    safety: Any  # isagi.safety.runtime.SafetyProfile
    context_threshold: float  # measured context shift (kept for the report; see isagi.pipeline.engine)
    report: dict[str, Any] = field(default_factory=dict)
    distance_scale: Any = None  # isagi.manifold.distance_scale.DistanceScale


def _corpus_digest() -> str:
    from isagi.data import load_followups, load_zones
    from isagi.data.safety import load_safety_corpus

    blob = json.dumps([load_zones(), load_safety_corpus(), load_followups()], sort_keys=True)
    return hashlib.sha256(blob.encode()).hexdigest()[:16]


# The modules whose code the calibration runs: what they do is part of the profile key.
DIGESTED_MODULES = ("isagi.manifold.ugt", "isagi.safety.runtime", "isagi.safety.calibration",
                    "isagi.safety.build", "isagi.safety.probe",
                    "isagi.manifold.distance_scale", "isagi.profile", "isagi.engines.hf.generation",
                    "isagi.manifold.pooling")
# Where a module lives is not what it does: the digest names every project module, a digested
# one and any the digested code imports, by the name it had when the digest began (module ->
# that name), so moving a module keeps the shipped profiles current. A move adds its row here;
# tests/test_profile_key.py checks that every moved module the digested code names has one.
DIGEST_NAMES = {
    "isagi.manifold.ugt": "isagi.ugt", "isagi.manifold.distance_scale": "isagi.distance_scale",
    "isagi.manifold.pooling": "isagi.pooling", "isagi.engines.hf.generation": "isagi.generation",
    "isagi.engines.hf.hooks": "isagi.hooks", "isagi.engines.hf.model": "isagi.model",
    "isagi.console.progress": "isagi.progress",
}
# The profiles that ship (isagi/profiles): backend -> the embedded default model's quantisation
# name on it (the engine's ``quant``), with the default settings.
SHIPPED_QUANTS = {"llamacpp": "gguf-Q4_1", "transformers": "nf4"}


def _canonical(node: ast.AST | list | object) -> str:
    """A node as text, the same on every Python ISAGI supports: fields in name order, empty
    and absent ones left out (so a field a later Python adds, such as ``type_params``, does
    not change it), positions left out."""
    if isinstance(node, ast.AST):
        fields = (f"{name}={_canonical(value)}" for name, value in sorted(ast.iter_fields(node))
                  if value is not None and value != [])
        return f"{type(node).__name__}({','.join(fields)})"
    if isinstance(node, list):
        return "[" + ",".join(_canonical(item) for item in node) + "]"
    return repr(node)


def digest_name(module: str) -> str:
    """The name the digest gives a project module (see :data:`DIGEST_NAMES`)."""
    return DIGEST_NAMES.get(module, module)


def code_behaviour(source: str) -> str:
    """What a module's code does, as text: its syntax tree without docstrings or any other
    bare string statement (comments and layout are not in the tree), with every imported
    module under its digest name."""
    tree = ast.parse(source)
    for node in ast.walk(tree):  # names first: the imports are sorted by them below
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
            node.module = digest_name(node.module)
        if isinstance(node, ast.Import):
            for alias in node.names:
                alias.name = digest_name(alias.name)
    for node in ast.walk(tree):
        body = getattr(node, "body", None)
        if isinstance(body, list):
            # (a node with a list body: mypy does not narrow on the getattr above; this module is digested,
            # isagi.profile.DIGESTED_MODULES, so its code stays as it is)
            node.body = _imports_sorted([s for s in body if not (isinstance(s, ast.Expr) and isinstance(s.value, ast.Constant)  # type: ignore[attr-defined]
                                                                 and isinstance(s.value.value, str))])
        if isinstance(node, ast.JoinedStr):  # an f-string's literal parts as one node each, none empty
            node.values = _joined(node.values)  # (Pythons from 3.12 split and pad them differently)
    return _canonical(tree)


def _imports_sorted(body: list[ast.stmt]) -> list[ast.stmt]:
    """``body`` with each run of consecutive import statements in one order (their text's): a
    move renames imports, and the import sorter then reorders them, which changes nothing."""
    out: list[ast.stmt] = []
    run: list[ast.stmt] = []
    for stmt in [*body, None]:
        if isinstance(stmt, ast.Import | ast.ImportFrom):
            run.append(stmt)
            continue
        out.extend(sorted(run, key=_canonical))
        run = []
        if stmt is not None:
            out.append(stmt)
    return out


def _joined(values: list[ast.expr]) -> list[ast.expr]:
    out: list[ast.expr] = []
    for value in values:
        if isinstance(value, ast.Constant) and isinstance(value.value, str):
            if not value.value:
                continue
            if out and isinstance(out[-1], ast.Constant) and isinstance(out[-1].value, str):
                out[-1] = ast.Constant(out[-1].value + value.value)
                continue
        out.append(value)
    return out


def module_sources() -> dict[str, str]:
    """module name -> source text of each digested module, as installed."""
    import importlib.util

    sources: dict[str, str] = {}
    for module in DIGESTED_MODULES:
        spec = importlib.util.find_spec(module)
        if spec is not None and spec.origin:
            sources[module] = Path(spec.origin).read_text(encoding="utf-8")
    return sources


def code_digest(sources: dict[str, str] | None = None) -> str:
    """The calibration code's part of the key: a changed method must not reuse an old profile,
    while a changed comment or docstring keeps the shipped profiles current."""
    sources = module_sources() if sources is None else sources
    h = hashlib.sha256()
    for module in DIGESTED_MODULES:
        if module in sources:
            h.update(f"{digest_name(module)}\x1f{code_behaviour(sources[module])}\x1e".encode())
    return h.hexdigest()[:16]


def profile_key(fingerprint: str, quant: str, layer: int, k: int, system_prompt: str, safety_layer: int | None = None,
                backend: str = "transformers", *, code: str | None = None) -> str:
    """The cache key: any input that changes the calibration changes the key (the backend too:
    llama.cpp's Q4_1 states and transformers' NF4 states of the same GGUF differ). ``code``:
    the calibration code's digest, today's (``code_digest()``) unless given."""
    parts = [backend, fingerprint, quant, str(layer), str(safety_layer if safety_layer is not None else layer), str(k),
             system_prompt, _corpus_digest(), code_digest() if code is None else code, str(PROFILE_VERSION)]
    return hashlib.sha256("\x1f".join(parts).encode()).hexdigest()[:24]


def _chat(system_prompt: str, text: str) -> list[dict[str, str]]:
    return [{"role": "system", "content": system_prompt}, {"role": "user", "content": text}]


def _calibrate_context(lm: Any, layer: int, basis: Basis, system_prompt: str) -> tuple[float, dict]:
    """Threshold on the UGT cosine distance between h(query alone) and h(query in context).

    Calibrated on the project's follow-up corpus: context-dependent follow-ups
    ("And Germany?") must lie above it, self-contained questions below. The
    threshold is the midpoint of the gap when the two groups separate, else the
    value that keeps every dependent follow-up above it (safety first: a
    self-contained question then merely loses the chance to be retrieved).
    """
    from isagi.data import load_followups
    from isagi.manifold.pooling import prompt_hidden_states

    rows = load_followups()
    alone = [_chat(system_prompt, r["followup"]) for r in rows]
    ctx = []
    for r in rows:
        msgs = [{"role": "system", "content": system_prompt}]
        for prior in r["context_a"]:
            msgs += [{"role": "user", "content": prior}, {"role": "assistant", "content": "…"}]
        msgs.append({"role": "user", "content": r["followup"]})
        ctx.append(msgs)
    xa = project(basis, prompt_hidden_states(lm, alone, layer))
    xc = project(basis, prompt_hidden_states(lm, ctx, layer))
    cos = np.sum(xa * xc, axis=1) / (np.linalg.norm(xa, axis=1) * np.linalg.norm(xc, axis=1) + 1e-12)
    delta = 1.0 - cos
    dep = np.array([not r["self_contained"] for r in rows])
    lo_dep = float(delta[dep].min()) if dep.any() else 1.0
    hi_self = float(delta[~dep].max()) if (~dep).any() else 0.0
    threshold = (lo_dep + hi_self) / 2 if lo_dep > hi_self else lo_dep * 0.999
    report = {
        "dependent_min": lo_dep,
        "self_contained_max": hi_self,
        "separated": bool(lo_dep > hi_self),
        "self_contained_below": float(np.mean(delta[~dep] < threshold)) if (~dep).any() else None,
        "n": len(rows),
    }
    return float(threshold), report


def build_profile(
    lm: Any, *, layer: int, k: int, system_prompt: str, quant: str, safety_layer: int | None = None,
    progress: Progress | None = None,
) -> Profile:
    """Run the calibration corpora through the model and fit every part of the profile."""
    from isagi.console.progress import counter
    from isagi.data import load_zones
    from isagi.manifold.pooling import prompt_hidden_states
    from isagi.safety.build import build_safety_profile

    started = time.perf_counter()
    report: dict[str, Any] = {}
    zones_rows = load_zones()
    tick = counter(progress, "UGT basis: hidden states of the zone corpus", len(zones_rows))
    H = prompt_hidden_states(lm, [_chat(system_prompt, r["text"]) for r in zones_rows], layer, progress=tick)
    labels = [r["zone"] for r in zones_rows]
    basis = fit_basis(H, k)
    refined, refine_report = refine_basis(H, labels, basis)
    report["refinement"] = refine_report
    if refine_report.get("separation_after", 0) > refine_report.get("separation_before", 0):
        basis = refined
    zones = fit_zones(project(basis, H), labels)
    report["k_effective"] = int(basis.B.shape[1])
    report["explained_variance"] = float(basis.explained)

    safety_layer = layer if safety_layer is None else safety_layer
    safety = build_safety_profile(lm, safety_layer, system_prompt, progress=progress)  # its stages report themselves
    if progress:
        progress("Context: follow-up calibration", 0, 1)
    context_threshold, ctx_report = _calibrate_context(lm, layer, basis, system_prompt)
    report["context"] = ctx_report
    if progress:
        progress("Context: follow-up calibration", 1, 1)
    from isagi.manifold.distance_scale import calibrate_on_pairs

    scale = calibrate_on_pairs(lm, layer, basis, system_prompt)
    report["seconds"] = round(time.perf_counter() - started, 2)
    return Profile(
        distance_scale=scale,
        key=profile_key(lm.fingerprint, quant, layer, k, system_prompt, safety_layer, getattr(lm, "backend", "transformers")),
        model_fingerprint=lm.fingerprint,
        layer=layer,
        k=k,
        basis=basis,
        zones=zones,
        safety=safety,
        context_threshold=context_threshold,
        report=report,
    )


def _flatten(prefix: str, state: dict[str, Any], arrays: dict[str, np.ndarray], meta: dict[str, Any]) -> None:
    for name, value in state.items():
        if isinstance(value, np.ndarray):
            arrays[f"{prefix}{name}"] = value
        else:
            meta[name] = value


def save_profile(profile: Profile, directory: Path) -> Path:
    """Write the profile atomically to ``directory/<key>/``."""
    arrays: dict[str, np.ndarray] = {
        "basis.B": profile.basis.B,
        "basis.mu": profile.basis.mu,
        "basis.singular_values": profile.basis.singular_values,
        "zones.centroids": profile.zones.centroids,
    }
    safety_meta: dict[str, Any] = {}
    _flatten("safety.", profile.safety.to_state(), arrays, safety_meta)
    meta = {
        "profile_version": PROFILE_VERSION,
        "isagi_version": __version__,
        "key": profile.key,
        "model_fingerprint": profile.model_fingerprint,
        "layer": profile.layer,
        "k": profile.k,
        "basis_explained": profile.basis.explained,
        "zones": profile.zones.names,
        "safety": safety_meta,
        "context_threshold": profile.context_threshold,
        "distance_scale": profile.distance_scale.to_state() if profile.distance_scale else None,
        "report": profile.report,
        "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
    }
    target = directory / profile.key
    directory.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".profile-", dir=directory))
    try:
        # numpy's stub: mypy matches a **dict against savez's allow_pickle keyword as well
        np.savez(tmp / "arrays.npz", **arrays)  # type: ignore[arg-type]
        (tmp / "profile.json").write_text(json.dumps(meta, indent=1, default=_json_default))
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target


def _json_default(value: Any) -> Any:
    if isinstance(value, np.generic):
        return value.item()
    if isinstance(value, np.ndarray):
        return value.tolist()
    raise TypeError(f"not JSON serialisable: {type(value).__name__}")


def load_profile(directory: Path, key: str) -> Profile | None:
    """The cached profile for ``key``, or ``None`` if there is none."""
    from isagi.safety.runtime import SafetyProfile

    path = directory / key
    if not (path / "profile.json").is_file():
        return None
    try:
        meta = json.loads((path / "profile.json").read_text())
        with np.load(path / "arrays.npz", allow_pickle=False) as npz:
            arrays = {name: npz[name] for name in npz.files}
        basis = Basis(
            B=arrays["basis.B"],
            mu=arrays["basis.mu"],
            singular_values=arrays["basis.singular_values"],
            explained=float(meta["basis_explained"]),
        )
        zones = Zones(names=list(meta["zones"]), centroids=arrays["zones.centroids"])
        safety_state = dict(meta["safety"])
        safety_state.update({n[len("safety."):]: a for n, a in arrays.items() if n.startswith("safety.")})
        safety = SafetyProfile.from_state(safety_state)
    except (OSError, KeyError, ValueError, TypeError) as exc:
        raise ProfileError(
            f"The cached profile in {path} is unreadable ({exc}). Delete that directory "
            "and ISAGI will calibrate again on the next start."
        ) from exc
    return Profile(
        key=key,
        model_fingerprint=meta["model_fingerprint"],
        layer=int(meta["layer"]),
        k=int(meta["k"]),
        basis=basis,
        zones=zones,
        safety=safety,
        context_threshold=float(meta["context_threshold"]),
        report=meta.get("report", {}),
        distance_scale=DistanceScale.from_state(meta["distance_scale"]) if meta.get("distance_scale") else None,
    )


def shipped_profiles_dir() -> Path:
    """Profiles that ship with the package: the embedded default model's, one per backend.

    Made by ``isagi profile build --out isagi/profiles`` (see the README of that
    directory); found by key like any cached profile, so a change of model,
    setting, corpus or calibration code simply misses them and calibrates anew.
    """
    return Path(__file__).resolve().parent / "profiles"


def key_for(lm: Any, settings: Any) -> tuple[str, int, int, str]:
    """(profile key, layer, safety layer, quantisation) of ``lm`` under ``settings``."""
    layer = settings.layer or lm.default_layer
    safety_layer = getattr(settings, "safety_layer", None) or lm.default_safety_layer
    quant = lm.quant  # the engine's: "gguf" for llama.cpp, the setting for transformers
    key = profile_key(lm.fingerprint, quant, layer, settings.k, settings.system_prompt, safety_layer,
                      getattr(lm, "backend", "transformers"))
    return key, layer, safety_layer, quant


def build_for(lm: Any, settings: Any, *, progress: Progress | None = None) -> Profile:
    """Calibrate ``lm`` under ``settings`` now (no cache is read): ``isagi profile build``."""
    _key, layer, safety_layer, quant = key_for(lm, settings)
    return build_profile(
        lm, layer=layer, k=settings.k, system_prompt=settings.system_prompt, quant=quant,
        safety_layer=safety_layer, progress=progress,
    )


def load_or_build_profile(lm: Any, settings: Any, *, progress: Progress | None = None) -> Profile:
    """The profile for this model and settings: from the cache, the package's shipped
    profiles, or calibrated now and cached."""
    key, layer, safety_layer, quant = key_for(lm, settings)
    cached = load_profile(settings.profiles_dir, key) or load_profile(shipped_profiles_dir(), key)
    if cached is not None:
        if cached.distance_scale is None:  # a profile cached before the scale existed
            from isagi.manifold.distance_scale import calibrate_on_pairs

            if progress:
                progress("Distance scale: calibration pairs", 0, 1)
            cached.distance_scale = calibrate_on_pairs(lm, layer, cached.basis, settings.system_prompt)
            save_profile(cached, settings.profiles_dir)
        return cached
    profile = build_for(lm, settings, progress=progress)
    save_profile(profile, settings.profiles_dir)
    return profile
