"""Fold BatchNorm (exact): the pass (:mod:`.fold`), which layer each BatchNorm folds into (:mod:`.match`,
:mod:`.layers`), its fp64 arithmetic (:mod:`.arithmetic`) and its per-tensor edits for a streamed checkpoint
(:mod:`.stream`)."""
