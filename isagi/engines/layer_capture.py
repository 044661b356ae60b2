"""Reading layer outputs out of llama.cpp's graph: the eval callback, compiled.

Owns :class:`LayerCapture`, what the llama.cpp engine installs as its
context's ``cb_eval``. llama.cpp's scheduler calls it for every node of every
graph (~940 nodes per decoded token for SmolLM2-135M): first to *ask*
whether the node's data is wanted, then, for a wanted node, with the data
(host memory on the CPU backend). The callback is compiled to machine code
with numba (``cfunc``): a ctypes callback that returned at once cost decoding
speed in Python calls alone (``isagi bench generate``'s ``capture_ratio``;
docs/measurements.md), and copying a wanted ``l_out-<il>`` into numpy then ran
in the interpreter too. Compiled, the
~940 asks per token cost nanoseconds each and the copy is a loop in machine
code; numba caches the compiled callback on disk, so only the first start
compiles it.

The callback's state is one int64 control array whose address is its
``user_data``: whether to capture, how many rows each wanted node holds,
whether to end the graph once every wanted node is read (prompt states only:
the later blocks and the output head are then skipped), whether anything
unexpected came, and per wanted node its name (compared up to its NUL), the
address, capacity and fill of its output buffer and the row width.
"""

from __future__ import annotations

import ctypes
from typing import Any

import numpy as np
from numba import carray, cfunc, types
from numba.core import cgutils
from numba.extending import intrinsic

_GGML_MAX_DIMS = 4
GGML_TYPE_F32 = 0


class GgmlTensor(ctypes.Structure):
    """The leading fields of ``struct ggml_tensor`` (vendor/llama.cpp/ggml/include/ggml.h)."""

    _fields_ = [
        ("type", ctypes.c_int),
        ("buffer", ctypes.c_void_p),
        ("ne", ctypes.c_int64 * _GGML_MAX_DIMS),
        ("nb", ctypes.c_size_t * _GGML_MAX_DIMS),
        ("op", ctypes.c_int),
        ("op_params", ctypes.c_int32 * 16),
        ("flags", ctypes.c_int32),
        ("src", ctypes.c_void_p * 10),
        ("view_src", ctypes.c_void_p),
        ("view_offs", ctypes.c_size_t),
        ("data", ctypes.c_void_p),
        ("name", ctypes.c_char * 64),
        ("extra", ctypes.c_void_p),
        ("padding", ctypes.c_char * 8),
    ]


# struct ggml_tensor read as int64 words: every field used is 8-byte aligned but ``type``
_TYPE_WORD = GgmlTensor.type.offset // 8
_NE_WORD = GgmlTensor.ne.offset // 8
_DATA_WORD = GgmlTensor.data.offset // 8
_NAME_WORD = GgmlTensor.name.offset // 8
_TENSOR_WORDS = _NAME_WORD + 2

MAX_LAYERS = 4  # layers one capture may read at once (a turn reads two)
# the control array: a header, then one slot per wanted layer
_ACTIVE, _N_SLOTS, _TRUNCATE, _PENDING, _MISSED, _ROWS, _DONE = range(7)
_HEADER = 8
_NAME0, _NAME1, _MASK0, _MASK1, _OUT, _CAP, _WRITTEN, _WIDTH = range(8)
_SLOT = 8
_CTL_LEN = _HEADER + MAX_LAYERS * _SLOT


@intrinsic
def _pointer(typingctx: Any, address: Any) -> Any:
    """An integer address as a void pointer (for ``numba.carray``)."""

    def codegen(context: Any, builder: Any, signature: Any, args: Any) -> Any:
        return builder.inttoptr(args[0], cgutils.voidptr_t)

    return types.voidptr(types.int64), codegen


def _callback(tensor: Any, ask: bool, user: Any) -> bool:
    ctl = carray(user, (_CTL_LEN,), np.int64)
    if ctl[_ACTIVE] == 0:
        return False
    t = carray(tensor, (_TENSOR_WORDS,), np.int64)
    w0, w1 = t[_NAME_WORD], t[_NAME_WORD + 1]
    j = -1  # the slot whose name the tensor has
    for k in range(ctl[_N_SLOTS]):
        s = _HEADER + k * _SLOT
        if (w0 & ctl[s + _MASK0]) == ctl[s + _NAME0] and (w1 & ctl[s + _MASK1]) == ctl[s + _NAME1]:
            j = k
            break
    if ask:
        return j >= 0
    s = _HEADER + j * _SLOT
    kind = t[_TYPE_WORD] & 0xFFFFFFFF  # ``type`` is the int at the struct's start (little-endian)
    width, rows = t[_NE_WORD], t[_NE_WORD + 1]
    if j < 0 or kind != GGML_TYPE_F32 or width != ctl[s + _WIDTH] or ctl[s + _WRITTEN] + rows > ctl[_ROWS]:
        ctl[_MISSED] = 1  # not what was asked for: complete() says so and the engine raises
        return True
    n = width * rows
    # numba's stub types an @intrinsic with its typing context as the first argument, which
    # compiled code never passes
    src = carray(_pointer(t[_DATA_WORD]), (n,), np.float32)  # type: ignore[call-arg]
    dst = carray(_pointer(ctl[s + _OUT]), (ctl[s + _CAP] * width,), np.float32)
    base = ctl[s + _WRITTEN] * width
    for i in range(n):
        dst[base + i] = src[i]
    ctl[s + _WRITTEN] += rows
    if ctl[s + _WRITTEN] == ctl[_ROWS]:
        ctl[_DONE] += 1
    ctl[_PENDING] -= 1
    # False ends this graph's compute: the later layers and the output head are skipped
    return not (ctl[_TRUNCATE] != 0 and ctl[_PENDING] == 0)


_COMPILED: Any = None


def compiled_callback() -> Any:
    """The ``cfunc`` of the callback: compiled on first use in a process (or loaded from numba's cache)."""
    global _COMPILED
    if _COMPILED is None:
        signature = types.boolean(types.voidptr, types.boolean, types.voidptr)
        try:
            # numba's stub of cfunc lists no nopython option; cfunc takes it (its **options)
            _COMPILED = cfunc(signature, nopython=True, cache=True)(_callback)  # type: ignore[call-arg]
        except RuntimeError:  # numba found no writable cache directory: compile for this process only
            _COMPILED = cfunc(signature, nopython=True)(_callback)  # type: ignore[call-arg]
    return _COMPILED


def name_words(name: bytes) -> tuple[int, int, int, int]:
    """(word 0, word 1, mask 0, mask 1): ``name`` and its NUL as the first 16 bytes of a tensor name."""
    if len(name) > 15:
        raise ValueError(f"tensor name {name!r} is longer than 15 bytes")
    raw = np.frombuffer((name + b"\0").ljust(16, b"\0"), dtype="<i8")
    mask = np.frombuffer((b"\xff" * (len(name) + 1)).ljust(16, b"\0"), dtype="<i8")
    return int(raw[0]), int(raw[1]), int(mask[0]), int(mask[1])


class LayerCapture:
    """The compiled callback's state: which ``l_out`` nodes to copy, and what was copied."""

    def __init__(self, width: int) -> None:
        self.width = int(width)
        self.ctl = np.zeros(_CTL_LEN, dtype=np.int64)
        self.wanted: dict[bytes, int] | None = None  # name -> ISAGI layer; None: capture nothing
        self._layers: list[int] = []  # the ISAGI layer of each slot
        self._buffers: dict[int, np.ndarray] = {}  # ISAGI layer -> (capacity, width) float32, reused
        self._set_for: dict[bytes, int] | None = None
        self.pointer = compiled_callback().address  # llama.cpp's cb_eval
        self.user_data = int(self.ctl.ctypes.data)  # and its user data: the control array

    def start(self, wanted: dict[bytes, int], n_tokens: int, truncate: bool = False) -> None:
        """Copy the ``wanted`` nodes (name -> layer), ``n_tokens`` rows each, in the next compute."""
        if len(wanted) > MAX_LAYERS:
            raise ValueError(f"at most {MAX_LAYERS} layers are read at once, not {len(wanted)}")
        ctl = self.ctl
        grow = any(len(self._buffers.get(layer, ())) < n_tokens for layer in wanted.values())
        if grow or (wanted is not self._set_for and wanted != self._set_for):
            for j, (name, layer) in enumerate(wanted.items()):
                buf = self._buffers.get(layer)
                if buf is None or len(buf) < n_tokens:
                    buf = self._buffers[layer] = np.empty((max(n_tokens, 64), self.width), dtype=np.float32)
                s = _HEADER + j * _SLOT
                ctl[s + _NAME0], ctl[s + _NAME1], ctl[s + _MASK0], ctl[s + _MASK1] = name_words(name)
                ctl[s + _OUT], ctl[s + _CAP], ctl[s + _WIDTH] = buf.ctypes.data, len(buf), self.width
            self._layers = list(wanted.values())
            ctl[_N_SLOTS] = len(wanted)
            self._set_for = wanted
        for j in range(len(self._layers)):
            ctl[_HEADER + j * _SLOT + _WRITTEN] = 0
        ctl[_TRUNCATE], ctl[_PENDING], ctl[_MISSED], ctl[_ROWS], ctl[_DONE] = int(truncate), len(wanted), 0, n_tokens, 0
        self.wanted = wanted
        ctl[_ACTIVE] = 1

    def restart(self) -> None:
        """Copy the same nodes again in the next compute (a decode cut and made again); nothing
        when no capture is armed."""
        if self.wanted is None:
            return
        ctl = self.ctl
        for j in range(len(self._layers)):
            ctl[_HEADER + j * _SLOT + _WRITTEN] = 0
        ctl[_PENDING], ctl[_MISSED], ctl[_DONE] = len(self.wanted), 0, 0

    def stop(self) -> None:
        self.ctl[_ACTIVE] = 0
        self.wanted = None

    def complete(self) -> bool:
        """Did the last compute copy every wanted node whole, and nothing unexpected?"""
        ctl = self.ctl
        return bool(ctl[_MISSED] == 0 and ctl[_DONE] == len(self._layers))

    def rows(self) -> dict[int, np.ndarray]:
        """The copied states {layer: (n_tokens, width)} as new arrays (the buffers are reused)."""
        n = int(self.ctl[_ROWS])
        return {layer: self._buffers[layer][:n].copy() for layer in self._layers}
