"""The ``.miku`` v2 session file: one self-describing, checksummed file.

This package owns the on-disk format of a saved session and nothing else: it
knows about headers, typed tensors, column-wise trajectories, a conversation
log and a small settings dict, but not what a metric or a basis *means*
(:mod:`isagi.session.files` checks that). The research code pickled a PyTorch
blob next to a JSON file and wrote it in place; this format cannot execute
code, is written atomically and is read strictly, and the reader and the
writer run the same checks, so a file ISAGI writes is one it can read back.
The format itself, its reading order and its bounds are specified in
docs/miku-format.md.

Each module owns one part:

- :mod:`~storage.miku.limits`: the bounds, and how a refusal is worded;
- :mod:`~storage.miku.frame`: magic, versions, checksums, dtypes, text groups;
- :mod:`~storage.miku.state`: :class:`MikuState` and a new file's header;
- :mod:`~storage.miku.validate`: the shape checks of headers, names, tensors;
- :mod:`~storage.miku.scanner`: the msgpack pre-scan of a meta;
- :mod:`~storage.miku.budget`: declared counts, memory and texts against the bounds;
- :mod:`~storage.miku.encode` and :mod:`~storage.miku.writer`: a state to
  bytes, and the bytes to disk atomically;
- :mod:`~storage.miku.reader` and :mod:`~storage.miku.decode`: a file read
  in the order that bounds its cost, and its meta turned into a state;
- :mod:`~storage.miku.legacy`: the import of the research code's v1 pair
  (not imported here: ``from storage.miku.legacy import read_legacy``).

The names below are the package's interface. The bounds are re-exported for
reading; a test that changes one changes it in :mod:`storage.miku.limits`,
where the reader and the writer look it up.
"""

from __future__ import annotations

from isagi.storage.miku.encode import encode_miku
from isagi.storage.miku.frame import (
    CHECKSUM_ALGOS,
    DEFAULT_CHECKSUM,
    DTYPES,
    FORMAT_MINOR,
    FORMAT_VERSION,
    MAGIC,
)
from isagi.storage.miku.limits import (
    MAX_EXTRA_DEPTH,
    MAX_LIST_LEN,
    MAX_MAP_LEN,
    MAX_MESSAGE_FIELDS,
    MAX_MESSAGES,
    MAX_META_DEPTH,
    MAX_META_ITEMS,
    MAX_MIKU_BYTES,
    MAX_NAME_LEN,
    MAX_NDIM,
    MAX_RECORD_LEN,
    MAX_STR_BYTES,
    MAX_STRINGS,
    MAX_TENSOR_ELEMENTS,
    MAX_TEXT_CHARS,
    MAX_TRAJECTORIES,
    MAX_TURNS,
    OBJECT_BUDGET_BYTES,
    OBJECT_BUDGET_PER_FILE_BYTE,
)
from isagi.storage.miku.reader import decode_miku, file_version, inspect_miku, read_miku
from isagi.storage.miku.state import MikuState, new_header, raw_size
from isagi.storage.miku.writer import remove_stale_temp_files, write_miku

__all__ = [
    "CHECKSUM_ALGOS",
    "DEFAULT_CHECKSUM",
    "DTYPES",
    "FORMAT_MINOR",
    "FORMAT_VERSION",
    "MAGIC",
    "MAX_EXTRA_DEPTH",
    "MAX_LIST_LEN",
    "MAX_MAP_LEN",
    "MAX_MESSAGES",
    "MAX_MESSAGE_FIELDS",
    "MAX_META_DEPTH",
    "MAX_META_ITEMS",
    "MAX_MIKU_BYTES",
    "MAX_NAME_LEN",
    "MAX_NDIM",
    "MAX_RECORD_LEN",
    "MAX_STRINGS",
    "MAX_STR_BYTES",
    "MAX_TENSOR_ELEMENTS",
    "MAX_TEXT_CHARS",
    "MAX_TRAJECTORIES",
    "MAX_TURNS",
    "OBJECT_BUDGET_BYTES",
    "OBJECT_BUDGET_PER_FILE_BYTE",
    "MikuState",
    "decode_miku",
    "encode_miku",
    "file_version",
    "inspect_miku",
    "new_header",
    "raw_size",
    "read_miku",
    "remove_stale_temp_files",
    "write_miku",
]
