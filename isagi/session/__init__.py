"""One chat session: the turn record (:mod:`.turn`), the session with its checkpoint and
rollback (:mod:`.state`) and its ``.miku`` file (:mod:`.files`)."""
