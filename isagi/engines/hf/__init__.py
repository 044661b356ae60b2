"""The transformers backend: the loaded model (:mod:`.model`), its forward hooks
(:mod:`.hooks`), generation with capture and steering (:mod:`.generation`) and the
engine that wraps them (:mod:`.engine`). Only this package imports torch's model code."""
