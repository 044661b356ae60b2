"""User-facing exceptions, in one place.

Every error a user can cause (a wrong model id, a corrupted file, an empty
message, a full disk) is one of these, and its message says what to do. The
CLI and the web app print the message, never a traceback.
"""

from __future__ import annotations

import errno


class IsagiError(Exception):
    """Base class: the message is shown to the user as it is."""


class ConfigError(IsagiError):
    """A setting or flag has a value ISAGI cannot use."""


class ModelLoadError(IsagiError):
    """The model could not be found, downloaded or loaded."""


class ModelStructureError(IsagiError):
    """The model's decoder layers could not be located."""


class InputError(IsagiError):
    """A message is empty, too long, or otherwise unusable."""


class SeedRefused(InputError):
    """The concept explorer's seed reads over the prompt guard's threshold: refused as the chat would refuse it."""


class ProfileError(IsagiError):
    """A per-model profile is missing, stale or unreadable."""


class SessionLimit(IsagiError):
    """Too many live sessions for this client, this user, or the server."""


class SessionBusy(IsagiError):
    """The session is in use by another event (e.g. a turn) of the same user."""


class ServerDraining(SessionBusy):
    """The server is shutting down (SIGTERM): it starts no turn and opens no session; another
    replica (behind a balancer), or this one started again, takes them."""


class SessionMoved(SessionBusy):
    """This process no longer holds the session's lease (its lease connection broke: PostgreSQL
    restarted, a network cut, a long pause) and another server has taken the session over: a
    write of it was refused (:mod:`isagi.storage.fences`), and this process drops its copy."""

    def __init__(self, message: str = "") -> None:
        super().__init__(message or MOVED)


# What a user is told when their chat was taken over by another server (SessionMoved): MOVED
# when the turn was not saved (it is not in the chat the other server continues), MOVED_SAVED
# when its file was saved before the takeover (that server has the turn). The page's words.
MOVED = ("This chat was taken over by another ISAGI server (this one lost its hold on it); "
         "reload the page to continue it there.")
MOVED_SAVED = ("This chat was taken over by another ISAGI server just after this reply was saved; "
               "reload the page to continue it there.")
# The API's words for the same two (an API client has no page to reload; app/api.py answers
# the first with a 503 that the balancer, or the client, sends again).
MOVED_API = ("Another ISAGI server now holds this conversation (this one lost its hold on it), and nothing "
             "of this request was kept; send the request again, with the same X-Isagi-Session header: "
             "behind the balancer it reaches that server.")
MOVED_SAVED_API = ("Another ISAGI server now holds this conversation; this reply was saved before it took "
                   "over, so send your next request as usual (same X-Isagi-Session header), not this one again.")


# What `isagi sessions delete` and `rename` say when a server has the session open (its lease
# held elsewhere); {verb}: delete or rename.
OPEN_ON_A_SERVER = ("Session {sid} is open on an ISAGI server that shares this session store; {verb} it "
                    "in that server's page (the API has no {verb}), or try again once the server has let it go "
                    "(it does when the chat is idle).")


class SessionNotFound(IsagiError):
    """No such session of the caller's (an unknown id and another owner's are the same)."""


class ConversationChanged(IsagiError):
    """A replayed conversation was continued by another request first."""


class StorageError(IsagiError):
    """Saving or loading failed (disk full, permission, unreadable database)."""


class PortInUseError(IsagiError):
    """The web app's address is taken by another program."""


class AnchorError(IsagiError):
    """``isagi bench serve``'s anchor, llama.cpp's own ``llama-server``, could not be built or started."""


class DataDirError(StorageError):
    """The data directory (``ISAGI_HOME``) cannot be written: missing rights, read-only, full."""


class UploadError(IsagiError):
    """A web upload that cannot be taken or opened: over the user's upload quota, or not
    a file this user uploaded (one message for every such file, whatever its path)."""


class MikuError(StorageError):
    """A ``.miku`` file is corrupted, truncated, or not a ``.miku`` file."""


# What a failed write says about its cause, by errno and by the database's own words.
_FULL_ERRNOS = {errno.ENOSPC, errno.EDQUOT}
_READ_ONLY_ERRNOS = {errno.EROFS, errno.EACCES, errno.EPERM}
_FULL_WORDS = ("database or disk is full", "no space left", "disk full", "disk quota")
_READ_ONLY_WORDS = ("read-only file system", "readonly database", "permission denied", "unable to open database")


def storage_cause(exc: BaseException) -> str:
    """Why a save or a history write failed, in words without a path: ``"the disk is full"``,
    ``"the data directory is read-only"`` or ``"a storage error"``.

    Looks at the errno of every exception in the chain and at the database
    driver's message (SQLite says "database or disk is full").
    """
    seen: BaseException | None = exc
    text = ""
    for _ in range(8):
        if seen is None:
            break
        code = getattr(seen, "errno", None)
        if code in _FULL_ERRNOS:
            return "the disk is full"
        if code in _READ_ONLY_ERRNOS:
            return "the data directory is read-only"
        text += " " + str(seen).lower()
        seen = seen.__cause__ or seen.__context__
    if any(w in text for w in _FULL_WORDS):
        return "the disk is full"
    if any(w in text for w in _READ_ONLY_WORDS):
        return "the data directory is read-only"
    return "a storage error"


def retry_when(cause: str) -> str:
    """When a write that failed for ``cause`` (:func:`storage_cause`'s words) will work again."""
    if cause == "the disk is full":
        return "once the disk has room again"
    if cause == "the data directory is read-only":
        return "once the data directory is writable again"
    return "once storage works again (the server log has the details)"


def not_saved_notice(cause: str) -> str:
    """What the user is told when a turn's autosave failed for ``cause``: one line, no path.

    The turn stands (shown, kept in memory); its file was not written; the server saves the
    whole chat again on its own every few seconds (the web app), and so does the next message.
    """
    return (f"This chat could not be saved ({cause}): its file was not written. This turn is shown and "
            f"kept in memory; your next message saves the whole chat again, with its history, and the web "
            f"app does so on its own within seconds {retry_when(cause)}.")
