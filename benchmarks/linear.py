"""Matrix products on the default model's weight shapes: torch's GEMM against
``packed_linear``, side by side (JSON lines).

One record per (dtype, rows, kernel): the median time of one pass over every matrix
product of a step — 30 layers of q/k/v (576 -> 960), o (576 -> 576), gate/up
(576 -> 3,072) and down (1,536 -> 576), each layer with its own weights so they come from
memory as in the engine, then the LM head (576 -> 49,152) — with the weight bytes and the
FLOPs per second that implies, and the speedup over torch's GEMM in the same run.
``rows`` is the batch: one per sequence in a decode step, up to
``max_num_batched_tokens`` in a prefill step.

    python benchmarks/linear.py [--rows 1,4,8,16,32,64,128,256,1024] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.models.linear import PackedWeight, linear

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
NUM_LAYERS, VOCAB, HIDDEN = 30, 49152, 576

Linear = Callable[[torch.Tensor, object], torch.Tensor]


def step_time(
    weights: list, in_features: list[int], rows: int, dtype: torch.dtype, run: Linear, repeats: int
) -> float:
    """Median seconds of one pass over ``weights`` with ``rows`` input rows."""
    inputs = {k: torch.randn(rows, k, dtype=dtype) for k in set(in_features)}
    samples = []
    for _ in range(repeats + 1):  # the first pass warms up
        begin = time.perf_counter()
        for w, k in zip(weights, in_features, strict=True):
            run(inputs[k], w)
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,256,1024")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(json.dumps({"record": "setup", "threads": torch.get_num_threads()}), flush=True)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        shapes = [(k, out) for _ in range(NUM_LAYERS) for k, out in LAYER_SHAPES]
        shapes.append((HIDDEN, VOCAB))
        weights = [torch.randn(out, k, dtype=dtype) for k, out in shapes]
        in_features = [k for k, _ in shapes]
        weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        kernels: dict[str, tuple[list, Linear]] = {
            "torch": (weights, F.linear),
            "packed": ([PackedWeight.pack(w) for w in weights], linear),
        }
        for rows in (int(r) for r in args.rows.split(",")):
            flop = 2 * rows * sum(w.numel() for w in weights)
            times = {
                name: step_time(prepared, in_features, rows, dtype, run, args.repeats)
                for name, (prepared, run) in kernels.items()
            }
            for name, seconds in times.items():
                record = {
                    "record": "step_matmuls",
                    "dtype": dtype_name,
                    "rows": rows,
                    "kernel": name,
                    "ms": round(1000 * seconds, 2),
                    "speedup_vs_torch": round(times["torch"] / seconds, 3),
                    "weight_gb_per_s": round(weight_bytes / seconds / 1e9, 2),
                    "gflop_per_s": round(flop / seconds / 1e9, 1),
                }
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
