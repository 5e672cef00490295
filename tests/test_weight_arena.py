"""Weights moved into one arena (pagedllm/models/weight_arena.py): same tensors, same
values, one region in the order given."""

from __future__ import annotations

import gc
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from shared_models import default_model

from pagedllm.models.weight_arena import ALIGNMENT, move_into_arena


def test_tensors_keep_identity_and_values_in_one_region_in_order():
    first = torch.randn(100, 37)
    tensors = [
        first,
        torch.randn(5).bfloat16(),
        torch.randint(0, 256, (33, 5), dtype=torch.uint8),
        first,  # a tensor held twice is moved once
    ]
    strided = torch.randn(8, 8).t()  # not contiguous: stays where it is
    before = [t.clone() for t in tensors]
    strided_ptr = strided.data_ptr()
    arena = move_into_arena([*tensors, strided])
    base = arena.data_ptr()
    offsets = [t.data_ptr() - base for t in tensors[:3]]
    assert offsets == sorted(offsets) and offsets[0] == 0
    assert all(offset % ALIGNMENT == 0 for offset in offsets)
    ends = [o + t.nbytes for o, t in zip(offsets, tensors[:3], strict=True)]
    assert max(ends) <= arena.nbytes
    assert strided.data_ptr() == strided_ptr
    del arena
    gc.collect()  # the tensors alone keep the region mapped
    for tensor, copy in zip(tensors, before, strict=True):
        assert tensor.dtype == copy.dtype and torch.equal(tensor, copy)


def test_loaded_model_weights_lie_in_forward_order():
    """The default model in bfloat16: every weight in one region, layer by layer, the
    LM head after the last layer, with at most alignment padding between them."""
    model = default_model(torch.bfloat16).model
    weights = model.weights()
    base = weights[0].data_ptr()
    offsets = [w.data_ptr() - base for w in weights]
    assert offsets == sorted(offsets)
    sizes = sum(-(-w.nbytes // ALIGNMENT) * ALIGNMENT for w in weights)
    assert offsets[-1] + weights[-1].nbytes <= sizes
    first_layer, last_layer = model.layers[0].weights(), model.layers[-1].weights()
    assert all(a is b for a, b in zip(weights, first_layer, strict=False))
    head = model.lm_head.blocks
    assert head.data_ptr() > max(t.data_ptr() for t in last_layer)


LOAD_AND_MEASURE = """
import json, torch
from pagedllm.models.loader import load_model

def anonymous_bytes():
    with open("/proc/self/smaps_rollup") as rollup:
        line = next(line for line in rollup if line.startswith("Anonymous:"))
    return int(line.split()[1]) * 1024

before = anonymous_bytes()
model = load_model(None, torch.bfloat16).model
print(json.dumps({"grown": anonymous_bytes() - before,
                  "weights": sum(t.nbytes for t in model.weights())}))
"""


@pytest.mark.skipif(not Path("/proc/self/smaps_rollup").exists(), reason="needs Linux /proc")
def test_loading_into_the_arena_leaves_no_second_copy():
    """In a fresh process, loading the default model grows anonymous memory by its
    weights plus the tokenizer and load-time leftovers, not by the weights twice (the
    tensors the loader built are freed once moved, views' bases included)."""
    result = subprocess.run(
        [sys.executable, "-c", LOAD_AND_MEASURE], capture_output=True, text=True, check=True
    )
    measured = json.loads(result.stdout.strip().splitlines()[-1])
    assert measured["grown"] < 1.25 * measured["weights"] + 90 * 2**20
