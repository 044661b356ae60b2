"""The uploads the web app will open: each one tied to the user who sent it.

Owns the ledger of files received by Gradio's upload route that are waiting
to be opened (:class:`UploadLedger`). Gradio hands an event handler whatever
path a client names in a file input (its own check that the file was uploaded
runs only in an app started by ``launch()``, and a path outside its cache is
first copied into it), so the app keeps its own record: the upload route's
answer is recorded for the user who made the request
(:mod:`app.guard`), and a file input is opened only when it names one of
*that user's* recorded uploads, exactly as the route answered it. Anything else
(another user's upload, a session file, the history database, a ``..`` path, a
symlink, an expired upload, a file that does not exist) gets one neutral
answer, :data:`NOT_YOUR_UPLOAD`, that says nothing about the path.

Opening an upload *claims* it: the file is moved out of the shared cache into
a private directory (one rename on the same file system) and checked there
(a regular file, the very file the route wrote: same device and inode), so
nothing can swap it between the check and the read, and it cannot be claimed
twice. The caller removes the private copy when done (:meth:`Claim.close`).

Disk: every user's uploads waiting to be opened, and those still arriving,
stay within ``quota_bytes`` (``ISAGI_UPLOAD_QUOTA_MB``): a new upload first
removes that user's oldest waiting ones to make room, and is refused when the
ones still arriving leave none. An upload is removed once opened or refused,
and one never opened is removed after ``ttl_s`` seconds (:meth:`sweep`, run by
a background thread and at every upload).
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import stat
import tempfile
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

from isagi.errors import UploadError

log = logging.getLogger(__name__)

MIB = 1024 * 1024
UPLOAD_TTL_S = 120.0  # an upload not opened by then is removed (the page opens it at once)
DOWNLOAD_TTL_S = 600.0  # a download the page handed out is removed from Gradio's cache after this
SWEEP_INTERVAL_S = 15.0
NOT_YOUR_UPLOAD = (
    "This file is not one you uploaded on this page, or it is no longer there: "
    "choose the .miku file again."
)


@dataclass
class _Upload:
    """One recorded upload of one user."""

    path: str  # as the upload route answered it (directory resolved, file name as is)
    quota_key: str
    size: int
    dev: int
    ino: int
    at: float  # when it was recorded or last named by an event (monotonic)
    # Uploads of the same file by the same user not yet opened: Gradio names a file by its
    # contents, so two tabs (or, without a login, two people) uploading one file get one path.
    count: int = 1


@dataclass
class Reservation:
    """Room held for an upload that is still arriving."""

    quota_key: str
    nbytes: int
    released: bool = False


@dataclass
class Claim:
    """A claimed upload: a private copy of the file, the user's own file name, removed by :meth:`close`."""

    path: Path
    name: str
    _dir: Path = field(repr=False)

    def close(self) -> None:
        shutil.rmtree(self._dir, ignore_errors=True)

    def __enter__(self) -> Claim:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def normalise(path: object, root: Path) -> str | None:
    """``path`` with its directory resolved (symlinks, ``..``) and its file name kept as
    written; None unless it is an absolute path strictly inside ``root``."""
    if not isinstance(path, str) or not path or "\0" in path or not os.path.isabs(path):
        return None
    folder, name = os.path.split(path)
    if name in ("", ".", ".."):
        return None
    try:
        real = Path(os.path.realpath(folder))
    except (OSError, ValueError):
        return None
    if real == root or root not in real.parents:
        return None
    return str(real / name)


class UploadLedger:
    """The uploads waiting to be opened, by user, with a disk quota per user and an expiry.

    ``root``: Gradio's upload cache (where its upload route writes). Every
    method is thread-safe; file removal happens under the lock (unlinks are
    quick), the claim's rename and checks outside it.
    """

    def __init__(self, root: str | os.PathLike[str], quota_bytes: int, *, ttl_s: float = UPLOAD_TTL_S,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.root = Path(os.path.realpath(root))
        self.quota_bytes = int(quota_bytes)
        self.ttl_s = float(ttl_s)
        self._clock = clock
        self._lock = threading.Lock()
        self._uploads: dict[tuple[str, str], _Upload] = {}  # (owner, path) -> upload
        self._handed: dict[str, tuple[str, float]] = {}  # a download's path in the cache -> (owner, when)
        self._arriving: dict[str, int] = {}  # quota key -> bytes reserved for uploads under way
        self._sweeper: threading.Thread | None = None
        self._stop = threading.Event()
        self.removed_total = 0

    # -- accounting ------------------------------------------------------------------
    def usage(self, quota_key: str) -> int:
        """Bytes of ``quota_key``'s uploads waiting to be opened plus those still arriving."""
        with self._lock:
            return self._usage(quota_key)

    def _usage(self, quota_key: str) -> int:
        waiting = sum(u.size for u in self._uploads.values() if u.quota_key == quota_key)
        return waiting + self._arriving.get(quota_key, 0)

    def reserve(self, quota_key: str, nbytes: int) -> Reservation:
        """Room for an upload of ``nbytes`` (its request's length) by ``quota_key``.

        The key's oldest waiting uploads are removed to make room; raises
        :class:`UploadError` when the upload alone is larger than the quota, or
        when uploads still arriving leave no room.
        """
        nbytes = max(0, int(nbytes))
        quota_mb = self.quota_bytes / MIB
        if nbytes > self.quota_bytes:
            raise UploadError(
                f"This upload ({nbytes / MIB:.1f} MiB) is larger than the upload quota of "
                f"{quota_mb:g} MiB per user (ISAGI_UPLOAD_QUOTA_MB); a .miku is at most 64 MiB."
            )
        self.sweep()
        with self._lock:
            mine = sorted((u for u in self._uploads.values() if u.quota_key == quota_key), key=lambda u: u.at)
            while mine and self._usage(quota_key) + nbytes > self.quota_bytes:
                self._drop(mine.pop(0))
            if self._usage(quota_key) + nbytes > self.quota_bytes:
                raise UploadError(
                    f"Your uploads under way already fill the upload quota of {quota_mb:g} MiB per "
                    "user (ISAGI_UPLOAD_QUOTA_MB): wait until they have finished, then upload again."
                )
            self._arriving[quota_key] = self._arriving.get(quota_key, 0) + nbytes
        return Reservation(quota_key, nbytes)

    def release(self, reservation: Reservation) -> None:
        """The upload has arrived (or failed): its room is no longer held."""
        with self._lock:
            if reservation.released:
                return
            reservation.released = True
            left = self._arriving.get(reservation.quota_key, 0) - reservation.nbytes
            if left > 0:
                self._arriving[reservation.quota_key] = left
            else:
                self._arriving.pop(reservation.quota_key, None)

    # -- recording and checking ------------------------------------------------------
    def record(self, owner: str, quota_key: str, paths: list[object]) -> list[str]:
        """Record the files the upload route answered for ``owner``; returns those recorded.

        A path that is not a regular file inside the cache is not recorded. An
        identical file uploaded by two users is one file (Gradio names it by
        its contents) with one record each; the file's device and inode are
        taken now, for the claim's check.
        """
        done: list[str] = []
        now = self._clock()
        for raw in paths:
            path = normalise(raw, self.root)
            if path is None:
                continue
            try:
                st = os.lstat(path)
            except OSError:
                continue
            if not stat.S_ISREG(st.st_mode):
                continue
            with self._lock:
                for u in self._uploads.values():  # the same file again: its records follow the new inode
                    if u.path == path:
                        u.dev, u.ino, u.size = st.st_dev, st.st_ino, st.st_size
                earlier = self._uploads.get((owner, path))
                self._uploads[(owner, path)] = _Upload(path, quota_key, st.st_size, st.st_dev, st.st_ino, now,
                                                       count=earlier.count + 1 if earlier is not None else 1)
            done.append(path)
        with self._lock:  # an upload larger than it said (it cannot be: the request's length bounds it)
            mine = sorted((u for u in self._uploads.values() if u.quota_key == quota_key), key=lambda u: u.at)
            while len(mine) > 1 and self._usage(quota_key) > self.quota_bytes:
                self._drop(mine.pop(0))
        return done

    def owns(self, owner: str, path: object) -> bool:
        """True when ``path`` names one of ``owner``'s waiting uploads (its expiry restarts:
        an event naming it is on its way)."""
        norm = normalise(path, self.root)
        if norm is None:
            return False
        with self._lock:
            u = self._uploads.get((owner, norm))
            if u is None:
                return False
            u.at = self._clock()
            return True

    def claim(self, owner: str, path: object) -> Claim | None:
        """Take ``owner``'s upload ``path`` out of the cache into a private directory and
        return it; None for anything that is not one of ``owner``'s waiting uploads."""
        norm = normalise(path, self.root)
        if norm is None:
            return None
        with self._lock:
            u = self._uploads.get((owner, norm))
            if u is None:
                return None
            if u.count > 1:  # the same user's other upload of this file still waits: leave it
                u.count -= 1
                shared = True
            else:
                del self._uploads[(owner, norm)]
                shared = any(o.path == norm for o in self._uploads.values())
        private = Path(tempfile.mkdtemp(prefix="isagi-claim-", dir=self.root))
        name = os.path.basename(norm)
        dest = private / name
        try:
            if shared:  # another user waits for the same file: leave it, take a copy
                _copy_nofollow(norm, dest, u)
            else:
                os.rename(norm, dest)
                _remove_empty_parent(Path(norm), self.root)
            st = os.lstat(dest)
            moved_another = not shared and (st.st_dev, st.st_ino) != (u.dev, u.ino)
            if not stat.S_ISREG(st.st_mode) or moved_another:
                raise OSError("not the file that was uploaded")
        except OSError as exc:
            log.warning("an upload could not be claimed: %s", exc)
            shutil.rmtree(private, ignore_errors=True)
            return None
        return Claim(dest, name, private)

    def discard(self, owner: str, path: object) -> bool:
        """Remove ``owner``'s waiting upload ``path`` (if it is one)."""
        norm = normalise(path, self.root)
        with self._lock:
            u = self._uploads.get((owner, norm or ""))
            if u is None:
                return False
            self._drop(u)
            return True

    # -- removal ---------------------------------------------------------------------
    def _drop(self, u: _Upload) -> None:
        """Forget ``u`` (lock held) and remove its file unless another user's record names it."""
        for key, v in list(self._uploads.items()):
            if v is u:
                del self._uploads[key]
        if any(v.path == u.path for v in self._uploads.values()):
            return
        with contextlib.suppress(OSError):
            st = os.lstat(u.path)
            if stat.S_ISREG(st.st_mode) and (st.st_dev, st.st_ino) == (u.dev, u.ino):
                os.unlink(u.path)
                self.removed_total += 1
        _remove_empty_parent(Path(u.path), self.root)

    def sweep(self, now: float | None = None) -> int:
        """Remove every upload waiting for longer than ``ttl_s``; returns how many."""
        now = self._clock() if now is None else now
        with self._lock:
            old = [u for u in self._uploads.values() if now - u.at > self.ttl_s]
            for u in old:
                self._drop(u)
            self._sweep_downloads(now)
        return len(old)

    # -- downloads --------------------------------------------------------------------
    def hand_out(self, owner: str, path: str | os.PathLike[str]) -> str | None:
        """Record that the file at ``path`` (inside the cache: where Gradio serves a download from)
        is ``owner``'s alone; it is removed after ``DOWNLOAD_TTL_S``. Returns the path recorded."""
        norm = normalise(os.fspath(path), self.root)
        if norm is not None:
            with self._lock:
                self._handed[norm] = (owner, self._clock())
        return norm

    def holders(self, path: object) -> set[str] | None:
        """Who may fetch the cached file ``path``: the owners of the waiting uploads and the
        download it is; None when it is neither (not a file this ledger knows)."""
        norm = normalise(path, self.root)
        if norm is None:
            return None
        with self._lock:
            who = {o for (o, p) in self._uploads if p == norm}
            if norm in self._handed:
                who.add(self._handed[norm][0])
        return who or None

    def _sweep_downloads(self, now: float) -> int:
        """Remove the handed-out downloads older than ``DOWNLOAD_TTL_S`` (lock held)."""
        old = [p for p, (_o, at) in self._handed.items() if now - at > DOWNLOAD_TTL_S]
        for p in old:
            del self._handed[p]
            with contextlib.suppress(OSError):
                if stat.S_ISREG(os.lstat(p).st_mode):
                    os.unlink(p)
            _remove_empty_parent(Path(p), self.root)
        return len(old)

    def waiting(self, owner: str | None = None) -> list[str]:
        """Paths of the uploads waiting to be opened (``owner``'s only, when given)."""
        with self._lock:
            return [k[1] for k in self._uploads if owner is None or k[0] == owner]

    def start_sweeper(self, interval_s: float = SWEEP_INTERVAL_S) -> None:
        """Run :meth:`sweep` every ``interval_s`` seconds in a daemon thread."""
        if self._sweeper is not None:
            return
        self._stop.clear()

        def loop() -> None:
            while not self._stop.wait(interval_s):
                try:
                    self.sweep()
                except Exception as exc:  # the sweeper must survive a bad file
                    log.warning("upload sweep failed: %s", exc)

        self._sweeper = threading.Thread(target=loop, name="isagi-upload-sweeper", daemon=True)
        self._sweeper.start()

    def stop_sweeper(self) -> None:
        self._stop.set()
        if self._sweeper is not None:
            self._sweeper.join(timeout=5)
        self._sweeper = None


def _copy_nofollow(src: str, dest: Path, u: _Upload) -> None:
    """Copy the upload ``src`` to ``dest`` without following a symlink, checking it is ``u``'s file."""
    fd = os.open(src, os.O_RDONLY | getattr(os, "O_NOFOLLOW", 0))
    with os.fdopen(fd, "rb") as f:
        st = os.fstat(f.fileno())
        if not stat.S_ISREG(st.st_mode) or (st.st_dev, st.st_ino) != (u.dev, u.ino):
            raise OSError("not the file that was uploaded")
        with open(dest, "xb") as out:
            shutil.copyfileobj(f, out)


def _remove_empty_parent(path: Path, root: Path) -> None:
    """Remove the upload's own folder (Gradio makes one per file) once it is empty; never ``root``."""
    parent = path.parent
    if parent != root and root in parent.parents:
        with contextlib.suppress(OSError):
            parent.rmdir()
