"""K/V storage: the tensors that hold the blocks' K and V, and what moves them.

- :mod:`~pagedllm.kv_storage.kv_cache`: the pool's memory, its layout and per-layer
  views (the attention backends write into them; docs/engine.md, "K/V storage and its
  writes");
- :mod:`~pagedllm.kv_storage.kv_quant`: the element formats (``kv_cache_dtype``) and the
  row encoding;
- :mod:`~pagedllm.kv_storage.swap_space`: the second tier, where preempted blocks wait;
- :mod:`~pagedllm.kv_storage.block_copies`: a step's block moves, applied in order.

Above :mod:`pagedllm.kv` (the block bookkeeping, which holds no tensor) and beside the
CPU kernels (:mod:`pagedllm.cpu`, for the pool's huge-page memory); below the attention
backends. The Triton kernels (:mod:`pagedllm.gpu`) read the formats from here.
"""
