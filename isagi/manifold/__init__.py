"""The living manifold's mathematics: numpy and FAISS only, no model and no files.

The UGT basis (:mod:`.ugt`), the COG metric (:mod:`.cog`), the memory and its two-stage
lookup (:mod:`.memory`), when two queries are the same (:mod:`.sameness`), the tier
decision (:mod:`.decide`), the distance scale (:mod:`.distance_scale`), which token states
are read out (:mod:`.pooling`) and which earlier exchanges a prompt holds (:mod:`.window`).
"""
