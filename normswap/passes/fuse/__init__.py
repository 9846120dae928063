"""Fused norms (exact within the kernel tolerance): norm modules (:mod:`.modules`), norms inside a forward
(:mod:`.graph`), a residual add fused into the norm that reads it (:mod:`.add_norm`)."""
