"""The kernels over GGUF blocks kept row by row (``quant_linear``), per block format,
activation dtype and number of rows (JSON lines).

Each record times one pass over ``--layers`` layers of a TinyLlama-1.1B-shaped model's
matrices (q/k/v 2,048 -> 2,560, o 2,048 -> 2,048, gate/up 2,048 -> 11,264 and down
5,632 -> 2,048; K a multiple of 256, as the K-quants need), each with its own random
blocks in one huge-page arena, in forward order, so they stream from memory as in an
engine step. The formats run row by row in both dtypes: in bfloat16, the K-quants
(the interleaved kernels take Q8_0, Q4_0 and Q4_1); in float32, every format.
``rows`` is the batch: 1 for one decode step, a few for a speculative verification,
more for prefill. Median seconds of ``--reps`` passes, every (format, dtype, rows) in
turns (:func:`~pagedllm.bench.race.race`), so background load hits all alike.

    python benchmarks/quant_linear.py [--formats Q4_K,Q5_K,Q6_K] [--dtypes bfloat16,float32]
        [--rows 1,4,9,64] [--layers 2] [--reps 7] [--threads N]
"""

from __future__ import annotations

import argparse
import json
from collections.abc import Callable

import gguf
import numpy as np
import torch

from pagedllm.bench.machine import machine_record
from pagedllm.bench.race import race
from pagedllm.models.quantized_weight import QuantizedWeight
from pagedllm.models.weight_arena import move_into_arena

LAYER_SHAPES = [(2560, 2048), (2048, 2048), (11264, 2048), (2048, 5632)]  # [out, in]
# Byte offsets of each K-quant block's half-precision scales (the rest random bytes).
HALF_OFFSETS = {"Q4_K": (0, 2), "Q5_K": (0, 2), "Q6_K": (208,)}


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def random_weight(name: str, n: int, k: int, rng: np.random.Generator) -> QuantizedWeight:
    """``[n, k]`` in format ``name``: random blocks with small finite scales (K-quants),
    or random weights quantized by the gguf package."""
    ggml_type = gguf.GGMLQuantizationType[name]
    values, nbytes = gguf.GGML_QUANT_SIZES[ggml_type]
    if name in HALF_OFFSETS:
        raw = rng.integers(0, 256, size=(n, k // values, nbytes), dtype=np.uint8)
        for offset in HALF_OFFSETS[name]:
            halves = rng.uniform(-0.01, 0.01, size=(n, k // values)).astype(np.float16)
            raw[:, :, offset : offset + 2] = halves.view(np.uint8).reshape(n, k // values, 2)
    else:
        weights = rng.standard_normal((n, k), dtype=np.float32) * 0.02
        raw = gguf.quants.quantize(weights, ggml_type)
    blocks = torch.from_numpy(np.ascontiguousarray(raw)).view(torch.uint8).reshape(n, -1)
    return QuantizedWeight(blocks, ggml_type, k)


def layers_of(name: str, layers: int, seed: int) -> list[QuantizedWeight]:
    """``layers`` layers' matrices in format ``name``, moved into one arena in order."""
    rng = np.random.default_rng(seed)
    weights = [random_weight(name, n, k, rng) for _ in range(layers) for n, k in LAYER_SHAPES]
    move_into_arena([w.blocks for w in weights])
    return weights


def step(weights: list[QuantizedWeight], inputs: dict[int, torch.Tensor]) -> Callable[[], None]:
    """One pass over ``weights``, each times the input of its width."""

    def run() -> None:
        for weight in weights:
            weight.linear(inputs[weight.in_features])

    return run


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--formats", default="Q4_K,Q5_K,Q6_K")
    parser.add_argument("--dtypes", default="bfloat16,float32")
    parser.add_argument("--rows", default="1,4,9,64")
    parser.add_argument("--layers", type=int, default=2)
    parser.add_argument("--reps", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    emit(**machine_record(), threads=args.threads)
    rows = [int(r) for r in args.rows.split(",")]
    generator = torch.Generator().manual_seed(0)
    widths = {k for _, k in LAYER_SHAPES}
    candidates: dict[str, Callable[[], None]] = {}
    labels: dict[str, dict[str, object]] = {}
    for index, name in enumerate(args.formats.split(",")):
        weights = layers_of(name, args.layers, seed=index)
        for dtype_name in args.dtypes.split(","):
            dtype = getattr(torch, dtype_name)
            for m in rows:
                inputs = {k: torch.randn(m, k, generator=generator).to(dtype) for k in widths}
                key = f"{name} {dtype_name} {m}"
                candidates[key] = step(weights, inputs)
                labels[key] = {"format": name, "dtype": dtype_name, "rows": m}
    seconds = race(candidates, args.reps)
    for key, label in labels.items():
        emit(measure="pass", layers=args.layers, **label, ms=round(1e3 * seconds[key], 3))


if __name__ == "__main__":
    main()
