"""User-facing exceptions, in one place.

Every error a user can cause (a wrong model id, a corrupted file, an empty
message, a full disk) is one of these, and its message says what to do. The
CLI and the web app print the message, never a traceback.
"""

from __future__ import annotations


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


class ProfileError(IsagiError):
    """A per-model profile is missing, stale or unreadable."""


class StorageError(IsagiError):
    """Saving or loading failed (disk full, permission, unreadable database)."""


class PortInUseError(IsagiError):
    """The web app's address is taken by another program."""


class UploadError(IsagiError):
    """A web upload that cannot be taken or opened: over the user's upload quota, or not
    a file this user uploaded (one message for every such file, whatever its path)."""


class MikuError(StorageError):
    """A ``.miku`` file is corrupted, truncated, or not a ``.miku`` file."""
