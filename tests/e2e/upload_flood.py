"""An upload flood against a live ``isagi web``, measured (issue 21): one logged-in user
sends N uploads of M MiB at once and never loads them, while the size of Gradio's upload
cache is sampled (each file counted once); then the same N one after another.

    python -m tests.e2e.upload_flood http://127.0.0.1:7860/ --auth bob:b --cache /tmp/gradio [--n 10 --mib 60]

``--cache`` is the server's upload cache (``GRADIO_TEMP_DIR``, by default
``<temp>/gradio``), on this machine. Prints one JSON object: the answers' statuses, the
time, and the cache's peak and final size in MiB.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import tempfile
import threading
import time
from pathlib import Path
from typing import Any

MIB = 1024 * 1024


def cache_bytes(root: Path) -> int:
    """Bytes of the files under ``root``, each file (inode) once."""
    seen: dict[tuple[int, int], int] = {}
    for p in root.rglob("*"):
        with contextlib.suppress(OSError):
            st = p.lstat()
            if p.is_file() and not p.is_symlink():
                seen[(st.st_dev, st.st_ino)] = st.st_size
    return sum(seen.values())


def run(url: str, auth: tuple[str, str], cache: Path, n: int, mib: int) -> dict[str, Any]:
    import httpx

    url = url.rstrip("/") + "/"
    work = Path(tempfile.mkdtemp(prefix="isagi-flood-"))
    block = os.urandom(mib * MIB - 16)
    files = []
    for i in range(2 * n):  # each file differs (Gradio names an upload by its contents)
        p = work / f"flood{i}.miku"
        p.write_bytes(f"{i:16}".encode() + block)
        files.append(p)
    base = cache_bytes(cache)
    peak, stop = base, threading.Event()

    def sample() -> None:
        nonlocal peak
        while not stop.is_set():
            peak = max(peak, cache_bytes(cache))
            time.sleep(0.002)

    def upload(path: Path, out: list[int]) -> None:
        with httpx.Client(base_url=url, timeout=600) as http:
            http.post("login", data={"username": auth[0], "password": auth[1]})
            with open(path, "rb") as f:
                try:
                    out.append(http.post("gradio_api/upload", files=[("files", (path.name, f))]).status_code)
                except httpx.TransportError:  # answered before the body was read
                    out.append(-1)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    at_once: list[int] = []
    t0 = time.perf_counter()
    threads = [threading.Thread(target=upload, args=(files[i], at_once)) for i in range(n)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    t_once = time.perf_counter() - t0
    in_turn: list[int] = []
    t0 = time.perf_counter()
    for i in range(n, 2 * n):
        upload(files[i], in_turn)
    t_turn = time.perf_counter() - t0
    stop.set()
    sampler.join()
    final = cache_bytes(cache)
    for p in files:
        p.unlink()
    work.rmdir()
    return {
        "uploads": n, "mib_each": mib,
        "at_once_statuses": sorted(at_once), "at_once_s": round(t_once, 2),
        "one_by_one_statuses": in_turn, "one_by_one_s": round(t_turn, 2),
        "cache_before_mib": round(base / MIB, 1), "cache_peak_mib": round(peak / MIB, 1),
        "cache_after_mib": round(final / MIB, 1),
    }


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("url")
    p.add_argument("--auth", required=True, help="user:password of the flooding user")
    p.add_argument("--cache", required=True, type=Path, help="the server's upload cache folder")
    p.add_argument("--n", type=int, default=10)
    p.add_argument("--mib", type=int, default=60)
    args = p.parse_args(argv)
    user, _, password = args.auth.partition(":")
    print(json.dumps(run(args.url, (user, password), args.cache, args.n, args.mib), indent=2))


if __name__ == "__main__":
    main()
