"""Recentering the residual stream (exact): LayerNorm -> RMSNorm (:mod:`.layernorm`) and pre-CRMSNorm, the
stream one dimension narrower (:mod:`.compress`)."""
