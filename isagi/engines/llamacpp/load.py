"""Loading a GGUF into llama.cpp and opening the engine's one context on it.

Owns what the llama.cpp engine is made of before it runs anything: the model
(a GGUF read as it is, the embedded default included, no conversion; its
quantisation name, part of the profile key), llama.cpp's log kept off stderr
(ISAGI reports its own errors), and the context's parameters: the attention
kernel, the batch size, the threads, one KV stream per slot and the eval
callback that reads layer outputs (:mod:`isagi.engines.llamacpp.forward`) and
the abort callback that lets Stop end a prompt's decode (:mod:`isagi.engines.llamacpp.abort`).
Kept apart so that what a context is made with is read in one place; the
benches that compare against llama-cpp-python's own ``Llama`` take
:data:`FLASH_ATTN` from here to run the same kernel.

The context uses llama.cpp's plain attention kernel, not flash attention: on
the CPU, flash attention decodes slower once a chat's history fills the KV
cache (``isagi bench attention`` measures both; docs/measurements.md has the
figures).

Under CPU contention (several processes on two cores) llama.cpp's threads
wait on each other at every node, and one thread runs faster than two: the
context is made with ``ISAGI_THREADS`` threads and
:mod:`isagi.engines.llamacpp.threads` moves it to one while that is so.
Benchmarks in this repository are rough for that reason.
"""

from __future__ import annotations

import ctypes
from pathlib import Path
from typing import Any

from isagi.engines.llamacpp.batched import GROUP_SEQS
from isagi.errors import ModelLoadError

FLASH_ATTN = 0  # llama_flash_attn_type: -1 AUTO (llama.cpp's default: on for the CPU), 0 disabled, 1 enabled
_LOG_SILENCER: Any = None


def _silence_llama_log(llama_cpp: Any) -> None:
    """llama.cpp logs every load step to stderr; ISAGI reports its own errors."""
    global _LOG_SILENCER
    if _LOG_SILENCER is None:
        _LOG_SILENCER = ctypes.CFUNCTYPE(None, ctypes.c_int, ctypes.c_char_p, ctypes.c_void_p)(lambda *_a: None)
        llama_cpp.llama_log_set(_LOG_SILENCER, None)


def start_backend(ll: Any) -> None:
    """llama.cpp's backend started, its log silenced (``ll``: the llama_cpp module)."""
    _silence_llama_log(ll)
    ll.llama_backend_init()


def load_model(ll: Any, path: Path) -> Any:
    """The GGUF at ``path`` as a llama.cpp model (free it with ``llama_model_free``);
    :class:`~isagi.errors.ModelLoadError` if llama.cpp cannot load it."""
    params = ll.llama_model_default_params()
    model = ll.llama_model_load_from_file(str(path).encode(), params)
    if not model:
        raise ModelLoadError(
            f"llama.cpp could not load {path}: is it a complete GGUF file? Re-download it, or "
            "use --backend transformers with a Hugging Face model directory."
        )
    return model


def model_quant(ll: Any, model: Any) -> str:
    """The GGUF's own quantisation as the profile key names it, e.g. ``gguf-Q4_1``."""
    desc = ctypes.create_string_buffer(256)
    ll.llama_model_desc(model, desc, len(desc))
    # e.g. "llama ?B Q4_1": the GGUF's own quantisation, part of the profile key
    return "gguf-" + (desc.value.decode("utf-8", "replace").split() or ["unknown"])[-1]


def open_context(ll: Any, model: Any, *, n_ctx: int, slots: int, n_threads: int, cb_eval: Any,
                 cb_eval_user_data: Any, path: Path, abort: Any = None, abort_user_data: Any = None) -> Any:
    """A context on ``model`` of ``n_ctx`` tokens per slot, with ``cb_eval`` (and ``abort``,
    :mod:`isagi.engines.llamacpp.abort`) installed for its whole life (the caller keeps the
    callbacks alive as long as the context); free it with
    ``llama_free``. :class:`~isagi.errors.ModelLoadError` (naming ``path``) if llama.cpp refuses."""
    cparams = ll.llama_context_default_params()
    # several sequences: one KV stream each (kv_unified off), so each decodes as in a context
    # of its own (isagi.engines.llamacpp_steps); n_ctx is then the sum of the slots' contexts
    cparams.n_ctx = n_ctx * slots
    # one slot: one KV cache that GROUP_SEQS sequences share, for the build's grouped passes
    # (isagi.engines.llamacpp.batched); everyday decodings use sequence 0 alone
    cparams.n_seq_max = slots if slots > 1 else GROUP_SEQS
    cparams.kv_unified = slots == 1
    cparams.n_batch = cparams.n_ubatch = 512
    cparams.n_threads = cparams.n_threads_batch = n_threads
    cparams.cb_eval = cb_eval
    cparams.cb_eval_user_data = cb_eval_user_data
    if abort is not None:
        cparams.abort_callback = abort
        cparams.abort_callback_data = abort_user_data
    # plain attention (see FLASH_ATTN); the benches' plain baseline uses the same kernel
    cparams.flash_attn_type = FLASH_ATTN
    ctx = ll.llama_init_from_model(model, cparams)
    if not ctx:
        raise ModelLoadError(f"llama.cpp could not create a context of {n_ctx} tokens for {path}.")
    return ctx
