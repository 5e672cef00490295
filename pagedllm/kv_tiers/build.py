"""The lower tiers an engine config asks for, sized from its budgets."""

from __future__ import annotations

import logging
from pathlib import Path

from pagedllm.config import EngineConfig
from pagedllm.kv.capacity import cdiv
from pagedllm.kv_storage.kv_cache import KVCache
from pagedllm.kv_tiers.disk_tier import DiskTier
from pagedllm.kv_tiers.fingerprint import tier_fingerprint
from pagedllm.kv_tiers.host_tier import HostTier
from pagedllm.kv_tiers.tiered_cache import TieredCache

logger = logging.getLogger(__name__)

GIB = 1 << 30


def host_tier_slots(
    kv_tier_memory: int, block_bytes: int, block_size: int, max_model_len: int
) -> int:
    """Blocks of the host tier: ``kv_tier_memory`` bytes of them, or, without (with only
    a directory), a staging tier of two ``max_model_len`` prompts (what a disk load
    passes through)."""
    if kv_tier_memory:
        slots = kv_tier_memory // block_bytes
        if slots < 1:
            raise ValueError(
                f"kv_tier_memory={kv_tier_memory} bytes holds no block of {block_bytes} bytes"
            )
        return slots
    return 2 * cdiv(max_model_len, block_size)


def make_tiered_cache(
    config: EngineConfig,
    source: Path,
    cache: KVCache,
    max_model_len: int,
) -> TieredCache | None:
    """The tiers under ``cache``'s pool (None without any), for the model loaded from
    ``source``; logs what they hold."""
    if not config.has_tiers:
        return None
    block = cache.tensor[:, :, 0]
    block_bytes = block.numel() * block.element_size()
    slots = host_tier_slots(config.kv_tier_memory, block_bytes, config.block_size, max_model_len)
    host = HostTier(slots, tuple(block.shape), cache.dtype, pin=cache.tensor.is_cuda)
    disk = None
    if config.kv_cache_dir is not None:
        # keys stored rotated are other bytes than the same format unrotated
        kv_format = cache.format.name + (" keys rotated" if cache.format.rotates_keys else "")
        fingerprint = tier_fingerprint(source, cache.tensor, kv_format, cache.block_size)
        disk = DiskTier(config.kv_cache_dir, config.kv_cache_dir_size, block_bytes, fingerprint)
    _log_tiers(config, host, disk)
    return TieredCache(cache.tensor, cache.block_size, host, disk, config.kv_tier_wait)


def _log_tiers(config: EngineConfig, host: HostTier, disk: DiskTier | None) -> None:
    gib = host.num_slots * host.block_bytes / GIB
    line = f"KV tiers: host memory {host.num_slots} blocks ({gib:.2f} GiB)"
    if disk is not None:
        stats = disk.stats()
        when = "arrives" if config.kv_tier_prefetch else "is next to be admitted"
        line += (
            f"; disk {config.kv_cache_dir}, {stats.entries} of {stats.capacity_entries} "
            f"blocks (limit {config.kv_cache_dir_size / GIB:.2f} GiB) found from earlier "
            f"runs; loads start when a request {when}, wait at most {config.kv_tier_wait} s"
        )
    logger.info(line)
