"""The llama.cpp engine: a GGUF on the CPU through llama-cpp-python's low-level API.

One engine in modules that each own one part of it:

- :mod:`.load`: loading the GGUF and opening the engine's one context (the
  attention kernel, :data:`FLASH_ATTN`; one KV stream per slot; the eval callback);
- :mod:`.threads`: the thread count of each ``llama_decode``, chosen by timing them
  (one thread while another program holds a core);
- :mod:`.abort`: the abort callback (a Stop inside a prompt's decode, a decode's deadline);
- :mod:`.text`: the GGUF's chat template, tokenising, token pieces to text;
- :mod:`.forward`: forward passes in one sequence, layer outputs read in the
  eval callback, the logits;
- :mod:`.sequences`: the KV cache's sequences: its owner, the slots, KV caches
  saved as prefixes and restored (with a context shift);
- :mod:`.decoding`: one reply (:class:`LlamaCppDecoding`): prefill, decoding,
  sampling, steering, cancelling;
- :mod:`.engine`: :class:`LlamaCppEngine`, the ModelEngine protocol over them.

Beside the package, and used by it: the saved KV caches' store
(:mod:`isagi.engines.kv_prefix`), the compiled eval callback
(:mod:`isagi.engines.layer_capture`), several replies' tokens in one
``llama_decode`` (:mod:`isagi.engines.llamacpp_steps`) and the one thread that
calls it (:mod:`isagi.engines.llama_thread`). Importers take the public names
from the package.
"""

from isagi.engines.llamacpp.decoding import LlamaCppDecoding
from isagi.engines.llamacpp.engine import LlamaCppEngine
from isagi.engines.llamacpp.load import FLASH_ATTN

__all__ = ["FLASH_ATTN", "LlamaCppDecoding", "LlamaCppEngine"]
