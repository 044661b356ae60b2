"""What the terminal shows: the chat's rendering (:mod:`.terminal`), tables
(:mod:`.tables`) and progress bars (:mod:`.progress`)."""
