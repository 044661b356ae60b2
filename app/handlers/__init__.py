"""The page's event handlers, one module per area of the page.

:mod:`~app.handlers.page` is what every area shares (the owner of a request, the view of a
session, alerts without server paths, the download folder); :mod:`~app.handlers.chat` the
chat tab (load, Send, Regenerate, Stop, sync, New chat); :mod:`~app.handlers.history` the
sessions table (search, Resume, Export, Delete); :mod:`~app.handlers.files` a session's
``.miku`` (Save, Load); :mod:`~app.handlers.explore` the concept explorer. Each handler
returns :class:`app.updates.PageUpdate` values; :class:`app.ui.WebUI` puts the areas together.
"""
