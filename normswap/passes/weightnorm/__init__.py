"""Weight normalization added or folded back (exact): the passes (:mod:`.layers`) and their per-tensor edits
for a streamed checkpoint (:mod:`.stream`)."""
