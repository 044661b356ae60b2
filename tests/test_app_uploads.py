"""The ledger of web uploads (app.uploads), on real files: a file is opened only by the
user who uploaded it, by the exact path the upload route answered; everything else
(another's upload, a file outside the cache, ``..``, a symlink swapped in, another
case, a file claimed twice) gets nothing, the same way whether or not the path exists;
a claim takes the file out of the shared cache; the quota holds, oldest first; unopened
uploads expire."""

from __future__ import annotations

import os
import secrets
from pathlib import Path

import pytest

from isagi.app.uploads import MIB, UploadLedger, normalise
from isagi.errors import UploadError


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


def arrive(ledger: UploadLedger, owner: str, data: bytes, name: str = "x.miku") -> str:
    """What Gradio's upload route does (a folder per file in the cache) and the guard records."""
    folder = ledger.root / secrets.token_hex(6)
    folder.mkdir()
    path = folder / name
    path.write_bytes(data)
    assert ledger.record(owner, owner, [str(path)]) == [str(path)]
    return str(path)


@pytest.fixture
def ledger(tmp_path: Path) -> UploadLedger:
    (tmp_path / "cache").mkdir()
    return UploadLedger(tmp_path / "cache", 10 * MIB, ttl_s=60, clock=Clock())


def test_only_the_uploader_opens_an_upload_once_and_it_leaves_the_cache(ledger: UploadLedger) -> None:
    path = arrive(ledger, "alice", b"alice's bytes")
    assert ledger.owns("alice", path) and not ledger.owns("bob", path)
    assert ledger.claim("bob", path) is None and Path(path).exists(), "bob's try changes nothing"
    claim = ledger.claim("alice", path)
    assert claim is not None and claim.name == "x.miku" and claim.path.read_bytes() == b"alice's bytes"
    assert not Path(path).exists() and not Path(path).parent.exists(), "taken out of the shared cache"
    assert ledger.claim("alice", path) is None, "a claimed upload cannot be claimed again"
    private = claim.path.parent
    assert private.parent == ledger.root and oct(private.stat().st_mode & 0o777) == "0o700"
    claim.close()
    assert not private.exists() and ledger.waiting() == []


def test_every_other_path_gets_the_same_nothing(ledger: UploadLedger, tmp_path: Path) -> None:
    secret = tmp_path / "home" / "sessions" / "alice.miku"
    secret.parent.mkdir(parents=True)
    secret.write_bytes(b"alice's session")
    mine = arrive(ledger, "bob", b"bob's own", name="Mine.miku")
    hers = arrive(ledger, "alice", b"alice's upload")
    folder = Path(mine).parent
    link = folder / "link.miku"
    link.symlink_to(secret)
    candidates = [
        str(secret), str(tmp_path / "home" / "history.sqlite3"), "/etc/passwd", hers,
        str(folder / ".." / Path(hers).parent.name / "x.miku"),  # alice's upload by a .. detour
        str(folder / "missing.miku"), str(link), str(folder / "mine.miku"),  # another case
        "relative/x.miku", "", None, 42, {"path": mine}, mine + "\0", str(ledger.root), str(folder),
    ]
    for path in candidates:
        assert ledger.claim("bob", path) is None, path
    assert secret.read_bytes() == b"alice's session" and Path(hers).exists() and Path(mine).exists()
    assert ledger.claim("bob", str(folder / "." / "Mine.miku")) is not None, "his own, spelt another way"


def test_a_symlink_swapped_in_after_the_upload_is_not_followed(ledger: UploadLedger, tmp_path: Path) -> None:
    secret = tmp_path / "secret.miku"
    secret.write_bytes(b"not for bob")
    path = arrive(ledger, "bob", b"bob's")
    os.unlink(path)
    os.symlink(secret, path)  # a race: the recorded path now names another file
    assert ledger.claim("bob", path) is None
    assert secret.read_bytes() == b"not for bob"
    path = arrive(ledger, "bob", b"bob's again")
    other = Path(path).with_name("other")
    other.write_bytes(b"another file at the same path")  # made while the upload exists: another inode
    os.replace(other, path)
    assert ledger.claim("bob", path) is None


def test_one_file_uploaded_by_two_users_serves_both(ledger: UploadLedger) -> None:
    path = arrive(ledger, "alice", b"same bytes")
    assert ledger.record("bob", "bob", [path]) == [path]  # Gradio names a file by its contents
    a = ledger.claim("alice", path)
    assert a is not None and Path(path).exists(), "bob's record keeps the file"
    b = ledger.claim("bob", path)
    assert b is not None and b.path.read_bytes() == a.path.read_bytes() == b"same bytes"
    assert not Path(path).exists()
    a.close()
    b.close()


def test_the_quota_removes_the_oldest_waiting_first_and_holds_for_arrivals(ledger: UploadLedger) -> None:
    clock = ledger._clock  # noqa: SLF001 - the test's clock
    first = arrive(ledger, "alice", b"a" * (4 * MIB))
    clock.t += 1
    second = arrive(ledger, "alice", b"b" * (4 * MIB))
    other = arrive(ledger, "bob", b"c" * (4 * MIB))
    assert ledger.usage("alice") == 8 * MIB
    r1 = ledger.reserve("alice", 4 * MIB)  # a third upload starts: the oldest waiting one makes room
    assert not Path(first).exists() and Path(second).exists() and Path(other).exists()
    assert ledger.usage("alice") == 8 * MIB
    r2 = ledger.reserve("alice", 4 * MIB)  # a fourth: the next oldest goes
    assert not Path(second).exists() and ledger.usage("alice") == 8 * MIB
    with pytest.raises(UploadError, match="under way already fill the upload quota of 10 MiB"):
        ledger.reserve("alice", 4 * MIB)  # room held by arrivals is never taken: refused
    for r in (r1, r2, r2):  # releasing twice is once
        ledger.release(r)
    assert ledger.usage("alice") == 0 and ledger.usage("bob") == 4 * MIB
    with pytest.raises(UploadError, match=r"larger than the upload quota of 10 MiB.*ISAGI_UPLOAD_QUOTA_MB"):
        ledger.reserve("bob", 11 * MIB)
    assert Path(other).exists(), "a refused upload removes nothing"


def test_uploads_not_opened_expire_and_naming_one_restarts_its_clock(ledger: UploadLedger) -> None:
    clock = ledger._clock  # noqa: SLF001
    old = arrive(ledger, "alice", b"old")
    clock.t += 50
    named = arrive(ledger, "alice", b"named")
    clock.t += 40
    assert ledger.owns("alice", named)  # an event names it: it is on its way
    clock.t += 30
    assert ledger.sweep() == 1 and not Path(old).exists() and Path(named).exists()
    clock.t += 61
    assert ledger.sweep() == 1 and not Path(named).exists() and ledger.waiting() == []
    assert not any(ledger.root.iterdir()), "their folders went too"


def test_discard_and_normalise(ledger: UploadLedger) -> None:
    path = arrive(ledger, "alice", b"x")
    assert not ledger.discard("bob", path) and Path(path).exists()
    assert ledger.discard("alice", path) and not Path(path).exists()
    root = ledger.root
    assert normalise(str(root / "a" / ".." / "b" / "f"), root) == str(root / "b" / "f")
    assert normalise(str(root / "f"), root) is None, "Gradio writes every upload in a folder of its own"
    assert normalise(str(root / ".." / "f"), root) is None and normalise(str(root / "a" / ".."), root) is None


def test_one_file_uploaded_twice_by_one_user_opens_twice(ledger: UploadLedger) -> None:
    """Gradio names an upload by its contents: the same .miku uploaded from two tabs (or, with
    no login, by two people) is one path with two waiting uploads. Each opens once; the
    file leaves the cache with the last."""
    first = arrive(ledger, "local", b"the same bytes")
    again = Path(first)  # Gradio writes the same bytes to the same path again
    again.write_bytes(b"the same bytes")
    assert ledger.record("local", "local", [first]) == [first]
    one = ledger.claim("local", first)
    assert one is not None and Path(first).exists(), "the other upload still waits"
    two = ledger.claim("local", first)
    assert two is not None and two.path.read_bytes() == b"the same bytes"
    assert not Path(first).exists() and ledger.claim("local", first) is None
    one.close()
    two.close()
    assert ledger.waiting() == []
