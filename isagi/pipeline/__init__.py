"""The turn: the engine that runs it as named stages (:mod:`.engine`) and where a finished
turn is kept, autosave and history rows (:mod:`.keeping`)."""
