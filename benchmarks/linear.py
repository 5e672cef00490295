"""Matrix products on the default model's weight shapes, the kernel choice's three
candidates side by side (JSON lines): ``packed_linear`` on panels (``packed``), torch's
oneDNN on weights in its blocked layout (``onednn``) and ``F.linear`` on the plain matrix
(``dense``).

``shape`` records: per dtype and weight shape, each candidate's seconds per row bucket
and score as :mod:`pagedllm.cpu.kernel_choice` times them (afresh, not from its cache),
then a ``shape_choice`` record with the kernel ``linear_kernel="auto"`` picks from them
(the preferred, ``packed``, when other processes kept the cores busy meanwhile:
``other_cores``), and the seconds the timing took.

``step_matmuls`` records, one per (dtype, rows, kernel): the median time of one pass
over every matrix product of a step — 30 layers of q/k/v (576 -> 960), o (576 -> 576),
gate/up (576 -> 3,072) and down (1,536 -> 576), each layer with its own weights so they
come from memory as in the engine, then the LM head (576 -> 49,152) — with the weight
bytes and the FLOPs per second that implies, the speedup over ``dense`` in the same
run, and the share of the multiply-add peak that rate is (``peak`` record: the
instruction ``packed_linear`` multiplies the dtype with, as ``benchmarks/peak.py`` times
it; oneDNN on AMX tiles can go past it).
``rows`` is the batch: one per sequence in a decode step, up to
``max_num_batched_tokens`` in a prefill step.

    python benchmarks/linear.py [--rows 1,4,8,16,32,64,128,256,1024] [--repeats 7]
        [--records shapes,steps] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F
from peak import dtype_peak

from pagedllm.cpu.extension import avx512_kernels_available
from pagedllm.cpu.kernel_choice import (
    contended,
    cpu_clock,
    other_cores,
    score,
    time_kernels,
    winner,
)
from pagedllm.models.linear import OneDNNWeight, PackedWeight, linear

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


def shape_records(dtype_name: str) -> None:
    """Each candidate's timings and the auto choice for every distinct weight shape."""
    dtype = getattr(torch, dtype_name)
    for k, out in [*LAYER_SHAPES, (HIDDEN, VOCAB)]:
        weight = torch.randn(out, k, dtype=dtype)
        begin, start = time.perf_counter(), cpu_clock()
        timings = time_kernels(weight, ("packed", "onednn", "dense"))
        seconds, end = time.perf_counter() - begin, cpu_clock()
        others = other_cores(start, end) if start and end else 0.0
        for kernel, per_rows in timings.items():
            record = {
                "record": "shape",
                "dtype": dtype_name,
                "out_features": out,
                "in_features": k,
                "kernel": kernel,
                "ms_by_rows": {rows: round(1000 * s, 4) for rows, s in per_rows.items()},
                "score_ms": round(1000 * score(per_rows), 3),
            }
            print(json.dumps(record), flush=True)
        choice = {
            "record": "shape_choice",
            "dtype": dtype_name,
            "out_features": out,
            "in_features": k,
            "auto": "packed" if contended(others) else winner(timings),
            "other_cores": round(others, 2),
            "timing_s": round(seconds, 3),
        }
        print(json.dumps(choice), flush=True)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", default="1,4,8,16,32,64,128,256,1024")
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--records", default="shapes,steps")
    parser.add_argument("--threads", type=int, help="torch threads (default: torch's)")
    args = parser.parse_args()
    if not avx512_kernels_available():
        parser.error("packed_linear needs the C++ kernels, built for a CPU with AVX-512")
    if args.threads:
        torch.set_num_threads(args.threads)
    print(json.dumps({"record": "setup", "threads": torch.get_num_threads()}), flush=True)
    records = args.records.split(",")
    for dtype_name in args.dtypes.split(","):
        if "shapes" in records:
            shape_records(dtype_name)
        if "steps" not in records:
            continue
        dtype = getattr(torch, dtype_name)
        shapes = [(k, out) for _ in range(NUM_LAYERS) for k, out in LAYER_SHAPES]
        shapes.append((HIDDEN, VOCAB))
        weights = [torch.randn(out, k, dtype=dtype) for k, out in shapes]
        in_features = [k for k, _ in shapes]
        peak = dtype_peak(dtype, torch.get_num_threads())
        if peak:
            record = {"record": "peak", "dtype": dtype_name, "instruction": peak[0]}
            print(json.dumps({**record, "gflop_per_s": round(peak[1], 1)}), flush=True)
        weight_bytes = sum(w.numel() * w.element_size() for w in weights)
        kernels: dict[str, tuple[list, Linear]] = {
            "onednn": ([OneDNNWeight.reorder(w) for w in weights], linear),
            "dense": (weights, F.linear),
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
                    "speedup_vs_dense": round(times["dense"] / seconds, 3),
                    "weight_gb_per_s": round(weight_bytes / seconds / 1e9, 2),
                    "gflop_per_s": round(flop / seconds / 1e9, 1),
                }
                if peak:
                    record["share_of_peak"] = round(flop / seconds / 1e9 / peak[1], 3)
                print(json.dumps(record), flush=True)


if __name__ == "__main__":
    main()
