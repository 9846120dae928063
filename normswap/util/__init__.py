"""Base utilities every layer may use: training-mode bookkeeping (:mod:`.modes`) and the tolerance
table (:mod:`.tolerance`). Nothing here imports another normswap subpackage except :mod:`normswap.errors`."""
