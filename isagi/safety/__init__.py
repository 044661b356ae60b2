"""Geometric safety, in parts that change for different reasons: the per-turn runtime
(:mod:`.runtime`: TEH, the reply guard, Safe OGD's projector) apart from the offline fit
(:mod:`.probe`: a probe as a forbidden subspace, folds, the two-budget threshold;
:mod:`.build`: the profile's safety part), the earlier Snipe construction and the ROC helpers
(:mod:`.calibration`), and the paper's construction kept as a baseline (:mod:`.baseline`)."""
