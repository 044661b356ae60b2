"""Creative exploration: Safe OGD chains (:mod:`.chains`) and their MCB scores (:mod:`.mcb`)."""
