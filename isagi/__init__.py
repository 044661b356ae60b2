"""ISAGI: a living-model chat application.

The package owns the living model (model loading, the UGT/COG manifold, the
geometric safety layer and the turn pipeline). It has no UI code and no SQL;
those live in ``app`` and ``storage``. Importing it does no work.
"""

__version__ = "0.1.0"
