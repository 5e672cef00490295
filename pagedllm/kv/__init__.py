"""The block bookkeeping of the KV cache: pool, tables, manager, prefix hashes,
fragmentation and the capacity arithmetic. Plain Python: no tensors, no kernels, nothing
from the layers above (the K/V tensors are :mod:`pagedllm.kv_storage`)."""
