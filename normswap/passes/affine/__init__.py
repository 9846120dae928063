"""Fold a norm's affine into its readers (exact, FlashNorm): the fold (:mod:`.fold`) and deferring the RMS
scale past the readers (:mod:`.defer_rms`)."""
