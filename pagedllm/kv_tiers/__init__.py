"""Lower tiers of the prefix cache: where evicted cached blocks go, and how they come back.

- :mod:`~pagedllm.kv_tiers.disk_tier`: blocks in checksummed entries of large files on
  local disk, kept across restarts.
"""
