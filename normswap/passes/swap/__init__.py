"""Architectural swaps (the function changes on purpose): one norm kind for another (:mod:`.swap_norm`, with
timm's norm+act modules in :mod:`.norm_act`) and cosine-normalized layers (:mod:`.cosine_layers`)."""
