"""Weights moved into one arena (pagedllm/models/weight_arena.py): same tensors, same
values, one region in the order given."""

from __future__ import annotations

import gc

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
