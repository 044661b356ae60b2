"""The msgpack pre-scan: a meta's structure checked before any of it is built.

Building msgpack objects costs far more memory than the bytes declaring them,
so :func:`_scan` walks the raw bytes first, counting every object and checking
nesting, string and map lengths and every declared length against the bytes
left, and only then :func:`_build` lets ``msgpack`` build it (under the same
limits, as a second guard). The reader scans a file's meta and checksum
record, the writer the meta it is about to write.
"""

from __future__ import annotations

import functools
from typing import Any

import msgpack

from isagi.storage.miku import limits
from isagi.storage.miku.limits import _fail


@functools.cache
def _msgpack_kinds() -> tuple[tuple[int, int], ...]:
    """For each first byte of a msgpack object: (kind, n).

    kind 0: a scalar of n bytes in all; 1: str/bin with an n-byte length;
    2: array with an n-byte count; 3: map with an n-byte count; 4: fixarray,
    5: fixmap, 6: fixstr (n = the low bits hold the size); -1: refused
    (extension types, the unused 0xc1).
    """
    kinds = [(-1, 0)] * 256
    for b in range(0x80):
        kinds[b] = (0, 1)  # positive fixint
    for b in range(0xE0, 0x100):
        kinds[b] = (0, 1)  # negative fixint
    for b in range(0x80, 0x90):
        kinds[b] = (5, 0)
    for b in range(0x90, 0xA0):
        kinds[b] = (4, 0)
    for b in range(0xA0, 0xC0):
        kinds[b] = (6, 0)
    for b in (0xC0, 0xC2, 0xC3):
        kinds[b] = (0, 1)  # nil, false, true
    for b, n in ((0xCA, 5), (0xCB, 9), (0xCC, 2), (0xCD, 3), (0xCE, 5), (0xCF, 9)):
        kinds[b] = (0, n)  # float32/64, uint8..64
    for b, n in ((0xD0, 2), (0xD1, 3), (0xD2, 5), (0xD3, 9)):
        kinds[b] = (0, n)  # int8..64
    for b, n in ((0xC4, 1), (0xC5, 2), (0xC6, 4), (0xD9, 1), (0xDA, 2), (0xDB, 4)):
        kinds[b] = (1, n)  # bin8/16/32, str8/16/32
    kinds[0xDC], kinds[0xDD] = (2, 2), (2, 4)
    kinds[0xDE], kinds[0xDF] = (3, 2), (3, 4)
    return tuple(kinds)


def _scan(buf: bytes, where: str) -> int:
    """Check one msgpack object's structure without building any of it.

    Counts every object (a container's declared items count as soon as its
    header is read, before any of them), bounds the total by MAX_META_ITEMS,
    the nesting by MAX_META_DEPTH, a string by MAX_STR_BYTES and a map by
    MAX_MAP_LEN (a list is bounded by the total), and checks that every
    declared length fits in the bytes that are left. Only then may ``msgpack``
    build objects (its own limits are the same, as a second guard):
    what it builds is bounded by the counts checked here, not by what a
    small file can declare (a few bytes per empty map made ~72 bytes each).
    Returns the number of objects.
    """
    kinds = _msgpack_kinds()
    # the limits as they are at this call, looked up once, not at every object
    max_items, max_depth = limits.MAX_META_ITEMS, limits.MAX_META_DEPTH
    max_str, max_map = limits.MAX_STR_BYTES, limits.MAX_MAP_LEN
    end = len(buf)
    pos = 0
    items = 1
    stack = [1]  # objects still to read in each open container
    from_bytes = int.from_bytes
    while stack:
        if not stack[-1]:
            stack.pop()
            continue
        stack[-1] -= 1
        if pos >= end:
            raise _fail(where, "not valid msgpack (truncated)")
        b = buf[pos]
        kind, n = kinds[b]
        if kind == 0:
            pos += n
            continue
        if kind == 6:
            pos += 1 + (b & 0x1F)
            continue
        if kind == 1:
            size = from_bytes(buf[pos + 1 : pos + 1 + n], "big")
            pos += 1 + n + size
            if pos > end:
                raise _fail(where, f"not valid msgpack (a {size}-byte string or blob does not fit)")
            if size > max_str and b >= 0xD9:  # str8/16/32 (a blob fits in a file)
                raise _fail(where, f"a string of {size} bytes, more than the limit of {max_str}")
            continue
        if kind == 4 or kind == 5:
            count = (b & 0x0F) * (2 if kind == 5 else 1)
            pos += 1
        elif kind == 2 or kind == 3:
            count = from_bytes(buf[pos + 1 : pos + 1 + n], "big") * (2 if kind == 3 else 1)
            pos += 1 + n
        else:
            raise _fail(where, f"not valid msgpack (type byte 0x{b:02x} is not allowed)")
        if count:
            items += count
            if items > max_items:
                raise _fail(where, f"holds more than {max_items} items")
            if count > end - pos:
                raise _fail(where, f"not valid msgpack ({count} items declared, {end - pos} bytes left)")
            if len(stack) >= max_depth:
                raise _fail(where, f"nested deeper than {max_depth} levels")
            if (kind == 3 or kind == 5) and count > 2 * max_map:
                raise _fail(where, f"a map of {count // 2} entries, more than the limit of {max_map}")
            stack.append(count)
    if pos != end:
        raise _fail(where, f"not valid msgpack ({end - pos} bytes after the end)" if pos < end else "not valid msgpack (truncated)")
    return items


def _unpack(buf: bytes, where: str) -> Any:
    """Scan, then build, one msgpack object."""
    _scan(buf, where)
    return _build(buf, where)


def _build(buf: bytes, where: str) -> Any:
    """Build a msgpack object already checked by :func:`_scan`."""
    try:
        return msgpack.unpackb(
            buf,
            raw=False,
            use_list=True,
            strict_map_key=True,
            max_str_len=limits.MAX_STR_BYTES,
            max_bin_len=limits.MAX_MIKU_BYTES,
            max_array_len=limits.MAX_LIST_LEN,
            max_map_len=limits.MAX_MAP_LEN,
            max_ext_len=0,
        )
    except Exception as exc:  # msgpack raises ValueError, TypeError, UnicodeDecodeError, ...
        raise _fail(where, f"not valid msgpack ({type(exc).__name__}: {str(exc)[:200]})") from None


