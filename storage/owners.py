"""Who owns a session: the one owner name of work done without a login.

Everything made without a login (the CLI, the web app without ``ISAGI_AUTH``,
the API on loopback without keys) belongs to :data:`LOCAL_OWNER`; under a
login the owner is the user name. A module of its own, with no imports, so
the session, the CLI, the page and the history store share the one constant
without any of them loading SQLAlchemy for it.
"""

LOCAL_OWNER = "local"
