"""KVCache: sizing from a byte budget, per-layer views, copy-on-write copies (the writes at a
slot mapping are the attention backend's: tests/test_attention_backend.py)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest
import torch

from pagedllm.cpu.allocator import huge_page_region
from pagedllm.kv.capacity import pool_blocks
from pagedllm.kv_storage.kv_cache import KVCache, bytes_per_block


def test_bytes_per_block_of_the_default_model():
    # SmolLM2-135M: 30 layers, 3 kv heads, head_dim 64; block of 16 tokens, K and V.
    assert bytes_per_block(30, 16, 3, 64, torch.float32) == 2 * 30 * 16 * 3 * 64 * 4 == 737_280
    assert bytes_per_block(30, 16, 3, 64, torch.bfloat16) == 368_640


def test_pool_blocks_round_down():
    per_block = bytes_per_block(30, 16, 3, 64, torch.float32)
    assert pool_blocks(2 * 2**30, per_block) == 2912
    assert pool_blocks(10 * per_block - 1, per_block) == 9
    assert pool_blocks(10 * per_block, per_block) == 10
    assert pool_blocks(0, per_block) == 0
    assert pool_blocks(10 * per_block, per_block, null_block=True) == 9
    assert pool_blocks(0, per_block, null_block=True) == 0


def test_from_budget_fits_the_budget():
    cache = KVCache.from_budget(10**6, 2, 8, 2, 16, torch.bfloat16)
    assert cache.num_blocks == 10**6 // bytes_per_block(2, 8, 2, 16, torch.bfloat16) == 488
    assert cache.nbytes <= 10**6
    assert cache.key(1).shape == (488, 2, 8, 16)
    assert cache.num_slots == 488 * 8


def test_block_size_must_be_a_power_of_two():
    with pytest.raises(ValueError, match="power of two"):
        KVCache(1, 4, 12, 1, 16)


def test_copy_blocks_copies_k_and_v_of_every_layer():
    cache = KVCache(num_layers=3, num_blocks=6, block_size=4, num_kv_heads=2, head_dim=16)
    cache.tensor.copy_(torch.randn(cache.tensor.shape))
    before = cache.tensor.clone()
    cache.copy_blocks([(1, 4), (2, 5)])
    assert torch.equal(cache.tensor[:, :, 4], before[:, :, 1])
    assert torch.equal(cache.tensor[:, :, 5], before[:, :, 2])
    untouched = [0, 1, 2, 3]
    assert torch.equal(cache.tensor[:, :, untouched], before[:, :, untouched])
    cache.copy_blocks([])
    assert torch.equal(cache.tensor[:, :, untouched], before[:, :, untouched])


def mapping_fields(address: int) -> dict[str, str]:
    """The /proc/self/smaps fields of the mapping holding ``address``."""
    fields: dict[str, str] = {}
    inside = False
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                low, high = (int(x, 16) for x in head.split("-"))
                inside = low <= address < high
            elif inside:
                fields[head.rstrip(":")] = line.split(":", 1)[1].strip()
    return fields


THP = Path("/sys/kernel/mm/transparent_hugepage/enabled")


@pytest.mark.skipif(
    not THP.exists() or "[never]" in THP.read_text(), reason="needs transparent huge pages"
)
def test_cpu_pool_is_zeroed_and_advised_for_huge_pages():
    """The pool's own mapping carries the advice (``hg`` in VmFlags, set only by
    MADV_HUGEPAGE) and the kernel counts it eligible. Whether memory that was not
    advised is eligible depends on the machine (per-size THP settings, glibc tunables,
    heap reuse), so it is not checked."""
    cache = KVCache(2, 64, 16, 3, 64, torch.bfloat16)
    assert cache.tensor.is_contiguous() and not cache.tensor.any()
    fields = mapping_fields(cache.tensor.data_ptr())
    assert "hg" in fields["VmFlags"].split()
    assert fields["THPeligible"] == "1"


def resident_bytes() -> int:
    """This process's resident memory, bytes."""
    return int(Path("/proc/self/statm").read_text().split()[1]) * os.sysconf("SC_PAGE_SIZE")


@pytest.mark.skipif(not Path("/proc/self/statm").exists(), reason="needs /proc/self/statm")
def test_cpu_pool_memory_is_committed_at_creation():
    """The pool's pages are taken when the pool is made, not at the first write into each
    block (where a page fault would land in the middle of a step); an uncommitted region
    of the same size takes no memory yet, so the check can tell the two apart."""
    nbytes = bytes_per_block(2, 16, 3, 64, torch.bfloat16) * 1024
    before = resident_bytes()
    cache = KVCache(2, 1024, 16, 3, 64, torch.bfloat16)
    assert cache.tensor.nbytes == nbytes and resident_bytes() - before >= nbytes
    before = resident_bytes()
    lazy = huge_page_region(nbytes)
    assert resident_bytes() - before < nbytes // 4
    del lazy
