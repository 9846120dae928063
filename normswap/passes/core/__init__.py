"""What every rewrite shares: the pass protocol and its one driver (:mod:`.base`), the pipeline that
validates each pass (:mod:`.pipeline`), the bookkeeping of graph rewrites (:mod:`.graph_rewrite`) and the
per-tensor edits the streamed route executes (:mod:`.edits`)."""
