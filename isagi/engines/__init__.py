"""Choosing and loading the engine that runs the model.

Owns the backend choice (``ISAGI_BACKEND=auto|llamacpp|transformers``, read
by :mod:`isagi.config`) and the sentence that says why, which ``isagi info``
prints. ``auto`` picks llama.cpp for the embedded default and any local
``.gguf`` file on the CPU, transformers for hub ids, Hugging Face model
directories and on CUDA. A combination that cannot work (llama.cpp with a hub
id, transformers with a bare ``.gguf`` file) is one :class:`ConfigError`.
"""

from __future__ import annotations

from pathlib import Path
from typing import TYPE_CHECKING

from isagi.engines.base import BACKENDS, Decoding, GenerationOptions, ModelEngine, TokenEvent
from isagi.errors import ConfigError

if TYPE_CHECKING:
    from isagi.config import Settings

__all__ = ["BACKENDS", "Decoding", "GenerationOptions", "ModelEngine", "TokenEvent", "choose_backend", "load_engine"]


def _model_kind(spec: str) -> str:
    """'default', 'gguf' (a local .gguf file), 'dir' (a local directory) or 'hub' (anything else)."""
    if spec == "default":
        return "default"
    local = Path(spec).expanduser()
    if local.is_file() and local.suffix.lower() == ".gguf":
        return "gguf"
    if local.is_dir():
        return "dir"
    if spec.lower().endswith(".gguf"):
        return "gguf"  # a missing file: the loader says so
    return "hub"


def _cuda_wanted(settings: Settings) -> bool:
    if settings.device == "cpu":
        return False
    if settings.device == "cuda":
        return True
    try:
        import torch

        return bool(torch.cuda.is_available())
    except ImportError:  # pragma: no cover - torch is a dependency
        return False


def choose_backend(settings: Settings) -> tuple[str, str]:
    """(backend, why) for ``settings``; raises :class:`ConfigError` for impossible combinations."""
    kind = _model_kind(settings.model)
    what = {"default": "the embedded default GGUF", "gguf": "a local .gguf file",
            "dir": "a Hugging Face model directory", "hub": "a Hugging Face hub id"}[kind]
    if settings.backend == "llamacpp":
        if kind in ("dir", "hub"):
            raise ConfigError(
                f"--backend llamacpp needs a GGUF model, but {settings.model!r} is {what}: use "
                "--model default or a .gguf file, or --backend transformers (or auto)."
            )
        if settings.device == "cuda":
            raise ConfigError("--backend llamacpp runs on the CPU here; use --device cpu/auto, or --backend transformers for CUDA.")
        return "llamacpp", f"ISAGI_BACKEND=llamacpp (or --backend) for {what}"
    if settings.backend == "transformers":
        if kind == "gguf":
            raise ConfigError(
                f"--backend transformers cannot load the GGUF file {settings.model!r}: use --backend "
                "llamacpp (or auto), or point --model at a Hugging Face model directory or hub id."
            )
        return "transformers", f"ISAGI_BACKEND=transformers (or --backend) for {what}"
    if kind in ("dir", "hub"):
        return "transformers", f"auto: {what} loads with transformers"
    if _cuda_wanted(settings):
        if kind == "gguf":
            raise ConfigError(
                f"{settings.model!r} is a GGUF file and ISAGI runs GGUF with llama.cpp on the CPU only: "
                "use --device cpu, or a Hugging Face model with CUDA."
            )
        return "transformers", "auto: CUDA is available, so transformers + bitsandbytes runs on the GPU"
    return "llamacpp", f"auto: {what} on the CPU runs fastest with llama.cpp"


def model_fingerprint(settings: Settings) -> str | None:
    """The fingerprint the configured model's engine will have (what a session file must record
    to load), without loading it; None when it cannot be known offline (a hub id)."""
    from isagi.engines.hf.model import default_gguf_path, dir_fingerprint, gguf_fingerprint

    if settings.model == "default":
        return gguf_fingerprint(default_gguf_path())
    path = Path(settings.model).expanduser()
    if path.is_file():
        return gguf_fingerprint(path)
    if path.is_dir() and (path / "config.json").is_file():
        return f"dir-sha256:{dir_fingerprint(path)}"
    return None


def load_engine(settings: Settings) -> ModelEngine:
    """The configured model behind the chosen backend; ISAGI's own BLAS then keeps to one
    thread, so it leaves the cores to the model (:mod:`isagi.engines.cpu_share`)."""
    from isagi.engines.cpu_share import keep_blas_single_threaded

    backend, why = choose_backend(settings)
    keep_blas_single_threaded()
    if backend == "transformers":
        from isagi.engines.hf.engine import TransformersEngine
        from isagi.engines.hf.model import load_model

        return TransformersEngine(load_model(settings), backend_reason=why)
    from isagi.engines.hf.model import DEFAULT_MODEL_ID, default_gguf_path, gguf_fingerprint
    from isagi.engines.llamacpp import LlamaCppEngine

    if settings.model == "default":
        path, model_id = default_gguf_path(), DEFAULT_MODEL_ID
    else:
        path = Path(settings.model).expanduser()
        if not path.is_file():
            from isagi.errors import ModelLoadError

            raise ModelLoadError(f"Model file {settings.model!r} does not exist; give the path of a .gguf file.")
        model_id = path.stem
    return LlamaCppEngine(path, model_id=model_id, fingerprint=gguf_fingerprint(path), n_threads=settings.threads,
                          n_ctx=context_per_slot(settings), backend_reason=why, slots=settings.slots,
                          adapt_threads=settings.adapt_threads)


def context_per_slot(settings: Settings) -> int:
    """The llama.cpp engine's context per sequence slot, in tokens (at most the model's trained
    context, which the engine caps it to): the prompt budget, the reply and a margin."""
    return settings.prompt_token_budget + settings.max_new_tokens + 64
