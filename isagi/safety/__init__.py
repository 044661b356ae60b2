"""Geometric safety, in two parts that change for different reasons: the per-turn runtime
(:mod:`.runtime`: TEH, the reply guard, Safe OGD's projector) apart from the offline
calibration that fits it (:mod:`.calibration`: Snipe, cross-validation, thresholds, the
profile build), and the paper's construction kept as a baseline (:mod:`.baseline`)."""
