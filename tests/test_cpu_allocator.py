"""Freed activation memory stays in the process: after ``keep_freed_memory()``, a tensor
of a forward pass's size allocated again and again reuses the same pages instead of
faulting in fresh ones each time."""

from __future__ import annotations

import resource
import sys

import pytest
import torch

from pagedllm.cpu.allocator import keep_freed_memory

PAGE_BYTES = resource.getpagesize()
TENSOR_BYTES = 16 * 1024 * 1024  # a [1024, 4096] float32 activation: gate/up of 1,024 tokens


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="glibc's malloc only")
def test_repeated_large_allocations_reuse_their_pages():
    assert keep_freed_memory()
    for _ in range(3):  # the heap grows to hold it
        torch.empty(TENSOR_BYTES // 4).fill_(1.0)
    # the fault counter is the whole process's: the quietest of three trials keeps
    # another thread's faults (torch's pools, a test's leftovers) out of the count
    faults = min(_faults_of_ten_allocations() for _ in range(3))
    # fresh pages every time would fault in about 10 x 4,096 pages
    assert faults < 2 * TENSOR_BYTES // PAGE_BYTES


def _faults_of_ten_allocations() -> int:
    before = resource.getrusage(resource.RUSAGE_SELF).ru_minflt
    for _ in range(10):
        torch.empty(TENSOR_BYTES // 4).fill_(1.0)
    return resource.getrusage(resource.RUSAGE_SELF).ru_minflt - before
