"""The llama.cpp engine (:mod:`.engine`): a GGUF on the CPU through llama-cpp-python's
low-level API. Importers take its public names from the package."""

from isagi.engines.llamacpp.decoding import LlamaCppDecoding
from isagi.engines.llamacpp.engine import LlamaCppEngine
from isagi.engines.llamacpp.load import FLASH_ATTN

__all__ = ["FLASH_ATTN", "LlamaCppDecoding", "LlamaCppEngine"]
