"""Few-row matrix products: torch's GEMM against ``streaming_linear``, side by side (JSON
lines), on the default model's weight shapes.

One record per (dtype, rows): the median time of one pass over every matrix product of
a decode step — 30 layers of q/k/v (576 -> 960), o (576 -> 576), gate/up (576 -> 3,072)
and down (1,536 -> 576), each layer with its own weights so they come from memory as in
the engine, then the LM head (576 -> 49,152) — and the weight bytes per second that
implies. ``rows`` is the decode batch. Where ``speedup`` falls below 1 is where
:data:`pagedllm.models.linear.STREAMING_MAX_ROWS` belongs.

    python benchmarks/linear.py [--rows 1,4,8,16,32,64,128,256] [--repeats 7]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from pagedllm.cpu import streaming_linear

LAYER_SHAPES = [(576, 960), (576, 576), (576, 3072), (1536, 576)]  # (in, out)
NUM_LAYERS, VOCAB = 30, 49152

Linear = Callable[[torch.Tensor, torch.Tensor], torch.Tensor]


def decode_step_time(weights: list[torch.Tensor], rows: int, linear: Linear, repeats: int) -> float:
    """Median seconds of one pass over ``weights`` with ``rows`` input rows."""
    inputs = {
        k: torch.randn(rows, k, dtype=weights[0].dtype) for k in {w.shape[1] for w in weights}
    }
    samples = []
    for _ in range(repeats + 1):  # the first pass warms up
        begin = time.perf_counter()
        for w in weights:
            linear(inputs[w.shape[1]], w)
        samples.append(time.perf_counter() - begin)
    return statistics.median(samples[1:])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,256")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    args = parser.parse_args()
    print(json.dumps({"record": "setup", "threads": torch.get_num_threads()}), flush=True)
    for dtype_name in args.dtypes.split(","):
        dtype = getattr(torch, dtype_name)
        weights = [
            torch.randn(out, k, dtype=dtype) for _ in range(NUM_LAYERS) for k, out in LAYER_SHAPES
        ]
        weights.append(torch.randn(VOCAB, 576, dtype=dtype))
        weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        for rows in (int(r) for r in args.rows.split(",")):
            gemm = decode_step_time(weights, rows, F.linear, args.repeats)
            streaming = decode_step_time(weights, rows, streaming_linear, args.repeats)
            record = {
                "record": "decode_step_matmuls",
                "dtype": dtype_name,
                "rows": rows,
                "torch_ms": round(1000 * gemm, 2),
                "streaming_ms": round(1000 * streaming, 2),
                "speedup": round(gemm / streaming, 3),
                "torch_weight_gb_per_s": round(weight_bytes / gemm / 1e9, 2),
                "streaming_weight_gb_per_s": round(weight_bytes / streaming / 1e9, 2),
                "streaming_gflop_per_s": round(
                    2 * rows * sum(w.numel() for w in weights) / streaming / 1e9, 1
                ),
            }
            print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
