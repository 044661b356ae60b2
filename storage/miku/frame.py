"""The constants both sides of the ``.miku`` format agree on, and its checksum.

The magic bytes and version of the frame, the checksum algorithms a file may
name (and one hasher over all of them), the dtypes a tensor may have, the key
set of a tensor descriptor and the groups of the string table. The writer
produces and the reader accepts exactly these; nothing here reads or writes a
file. The layout they describe: docs/miku-format.md.
"""

from __future__ import annotations

import hashlib
import struct
import sys
import zlib

import numpy as np

MAGIC = b"\x89MIKU\r\n\x1a"
FORMAT_VERSION = 2  # major: the header's format_version
FORMAT_MINOR = 1  # written; minors 0 and 1 are read
_PREFIX = struct.Struct("<8sHHI")  # magic, major, minor, checksum record length
_META_LEN = struct.Struct("<I")

# Named checksum algorithms a reader accepts (name -> digest size in bytes).
CHECKSUM_ALGOS: dict[str, int] = {"crc32": 4, "blake2b": 64, "sha256": 32}
DEFAULT_CHECKSUM = "crc32"

# dtype name -> little-endian numpy dtype. Nothing else is ever decoded.
DTYPES: dict[str, np.dtype] = {
    "float16": np.dtype("<f2"),
    "float32": np.dtype("<f4"),
    "float64": np.dtype("<f8"),
    "int8": np.dtype("i1"),
    "int16": np.dtype("<i2"),
    "int32": np.dtype("<i4"),
    "int64": np.dtype("<i8"),
    "uint8": np.dtype("u1"),
    "bool": np.dtype("?"),
}
_NATIVE_LE = sys.byteorder == "little"
_TENSOR_KEYS = frozenset({"dtype", "shape", "offset"})  # a v2.1 tensor descriptor

# Text groups: (largest code point, encoding). Separators are tried in order.
_TEXT_GROUPS = ((0xFF, "latin-1"), (0xFFFF, "utf-8"), (0x10FFFF, "utf-8"))
_ENCODINGS = frozenset(enc for _, enc in _TEXT_GROUPS)
_SEPARATORS = tuple(map(chr, range(32)))


class _Hasher:
    """One interface over zlib.crc32 and hashlib (update with buffers, then digest)."""

    def __init__(self, algo: str) -> None:
        self.algo = algo
        self._crc = 0
        self._h = None if algo == "crc32" else hashlib.new(algo)

    def update(self, data: bytes | memoryview) -> None:
        if self._h is None:
            self._crc = zlib.crc32(data, self._crc)
        else:
            self._h.update(data)

    def digest(self) -> bytes:
        if self._h is None:
            return self._crc.to_bytes(4, "big")
        return self._h.digest()
