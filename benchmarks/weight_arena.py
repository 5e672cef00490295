"""Matrix products of one decode step streamed from where the weights lie (JSON lines).

The weights of a SmolLM2-135M-shaped model (30 layers of q/k/v, output, gate/up and down
matrices, then the 49,152-row LM head), random values, multiplied by one row each in
forward order, as a one-sequence decode step does. Three placements of the same
weights: ``separate`` (one allocation per matrix, as the loaders make them),
``arena`` (one region in forward order, 4 KiB pages) and ``arena_huge`` (the same,
advised for 2 MiB transparent huge pages: what :mod:`pagedllm.models.weight_arena`
does). Forms: packed float32 and bfloat16 panels, and Q4_1 blocks interleaved for
bfloat16 (the shipped file's format). Median of ``--reps`` alternating runs per
placement; ratios to ``separate``.

    python benchmarks/weight_arena.py [--reps 15] [--rows 1]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import gguf
import numpy as np
import torch

from pagedllm.bench.machine import machine_record
from pagedllm.models.interleaved_weight import InterleavedWeight
from pagedllm.models.linear import PackedWeight, linear, weight_storage
from pagedllm.models.quantized_weight import QuantizedWeight
from pagedllm.models.weight_arena import move_into_arena

LAYER_SHAPES = [(960, 576), (576, 576), (3072, 576), (576, 1536)]  # [out, in]
SHAPES = LAYER_SHAPES * 30 + [(49152, 576)]


def q4_1(out_features: int, in_features: int) -> InterleavedWeight:
    values = np.random.randn(out_features, in_features).astype(np.float32) * 0.05
    blocks = gguf.quants.quantize(values, gguf.GGMLQuantizationType.Q4_1)
    tensor = torch.from_numpy(np.ascontiguousarray(blocks)).view(torch.uint8)
    weight = QuantizedWeight(tensor.reshape(out_features, -1), gguf.GGMLQuantizationType.Q4_1,
                             in_features)  # fmt: skip
    return InterleavedWeight.interleave(weight)


FORMS: dict[str, tuple[torch.dtype, Callable[[int, int], object]]] = {
    "float32 packed": (
        torch.float32, lambda n, k: PackedWeight.pack(torch.randn(n, k) * 0.05)
    ),
    "bfloat16 packed": (
        torch.bfloat16,
        lambda n, k: PackedWeight.pack((torch.randn(n, k) * 0.05).bfloat16()),
    ),
    "Q4_1 interleaved": (torch.bfloat16, q4_1),
}


def placed(weights: list, placement: str) -> list:
    """Copies of ``weights`` (their storage tensors cloned one by one), moved into an
    arena unless ``placement`` is ``separate``."""
    copies = []
    for weight in weights:
        storage = weight_storage(weight)
        clone = storage.clone()
        if isinstance(weight, PackedWeight):
            copies.append(PackedWeight(clone, weight.out_features, weight.in_features))
        else:
            copies.append(InterleavedWeight(clone, weight.ggml_type, weight.in_features,
                                            weight.out_features))  # fmt: skip
    if placement != "separate":
        move_into_arena([weight_storage(w) for w in copies], placement == "arena_huge")
    return copies


def step(weights: list, inputs: dict[int, torch.Tensor]) -> None:
    """Every weight times the input of its width, in order."""
    for weight in weights:
        linear(inputs[weight.in_features], weight)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--reps", type=int, default=15)
    parser.add_argument("--rows", type=int, default=1)
    args = parser.parse_args()
    print(json.dumps(machine_record()), flush=True)
    for form, (dtype, make) in FORMS.items():
        weights = [make(n, k) for n, k in SHAPES]
        nbytes = sum(weight_storage(w).numel() * weight_storage(w).element_size() for w in weights)
        inputs = {k: torch.randn(args.rows, k).to(dtype) for k in {k for _, k in SHAPES}}
        placements = {p: placed(weights, p) for p in ("separate", "arena", "arena_huge")}
        del weights

        times: dict[str, list[float]] = {p: [] for p in placements}
        for ws in placements.values():
            step(ws, inputs)
        for _ in range(args.reps):
            for p, ws in placements.items():
                start = time.perf_counter()
                step(ws, inputs)
                times[p].append(time.perf_counter() - start)
        ms = {p: 1e3 * statistics.median(t) for p, t in times.items()}
        print(json.dumps({
            "form": form,
            "rows": args.rows,
            "weight_bytes": nbytes,
            "ms": {p: round(v, 3) for p, v in ms.items()},
            "gb_s": {p: round(nbytes / v / 1e6, 1) for p, v in ms.items()},
            "speedup_vs_separate": {p: round(ms["separate"] / v, 3) for p, v in ms.items()},
        }), flush=True)  # fmt: skip


if __name__ == "__main__":
    main()
