"""Decode speed of the model in float32 against bfloat16, side by side in one run.

What is measured: one decode step of the model alone (embedding, all layers, final
norm, LM head over every row) for a batch of B sequences that each run one new
token at position ``--position``. Attention goes through the dense backend, so each
token attends only to itself: the numbers are the cost of everything *but*
attention over a long context (that is benchmarks/attention.py's subject).
Timings alternate between the dtypes so background load hits both alike.

Prints JSON lines: the machine, load time and resident memory per dtype, then per
batch size the median step time, steps/s and tokens/s of each dtype and the ratio.
``median_cpu_ms`` is the process CPU time of a step: on a shared machine, with
``--threads 1``, it is closer than wall time to what the step costs on an idle core.

    python benchmarks/dtype_decode.py [--model PATH] [--batches 1,64] [--reps 9] [--threads N]
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import statistics
import time

import psutil
import torch

from pagedllm.attention.dense_backend import DenseAttentionBackend, dense_metadata
from pagedllm.models import load_model

DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16}


def emit(**record: object) -> None:
    print(json.dumps(record), flush=True)


def rss_mb() -> float:
    return psutil.Process().memory_info().rss / 2**20


def peak_rss_mb() -> float:
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024  # Linux reports KiB


def decode_step(model, batch: int, position: int):
    """A closure running one decode step of ``batch`` one-token sequences."""
    ids = torch.randint(
        0, model.config.vocab_size, (batch,), generator=torch.Generator().manual_seed(0)
    )
    positions = torch.full((batch,), position)
    metadata = dense_metadata([1] * batch)
    backend = DenseAttentionBackend()

    def step() -> None:
        model.compute_logits(model.forward(ids, positions, backend, metadata))

    return step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument(
        "--model", default=None, help="GGUF file or HF folder; default model if omitted"
    )
    parser.add_argument("--batches", default="1,64", help="comma-separated batch sizes")
    parser.add_argument("--position", type=int, default=128, help="position of each new token")
    parser.add_argument("--reps", type=int, default=9, help="timed steps per dtype and batch")
    parser.add_argument(
        "--threads", type=int, default=None, help="torch threads (default: torch's)"
    )
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    emit(
        metric="machine",
        cpus=os.cpu_count(),
        torch_threads=torch.get_num_threads(),
        load_average=os.getloadavg()[0],
        torch=torch.__version__,
    )

    models = {}
    for name, dtype in DTYPES.items():
        start = time.perf_counter()
        models[name] = load_model(args.model, dtype=dtype).model
        seconds = time.perf_counter() - start
        decode_step(models[name], 64, args.position)()  # the largest batch's buffers
        emit(
            metric="load",
            dtype=name,
            seconds=round(seconds, 2),
            rss_mb=round(rss_mb()),
            peak_rss_mb_so_far=round(peak_rss_mb()),
        )

    for batch in (int(b) for b in args.batches.split(",")):
        steps = {name: decode_step(model, batch, args.position) for name, model in models.items()}
        wall: dict[str, list[float]] = {name: [] for name in steps}
        cpu: dict[str, list[float]] = {name: [] for name in steps}
        for step in steps.values():
            step()
        for _ in range(args.reps):
            for name, step in steps.items():
                start, start_cpu = time.perf_counter(), time.process_time()
                step()
                wall[name].append(time.perf_counter() - start)
                cpu[name].append(time.process_time() - start_cpu)
        medians = {name: statistics.median(t) for name, t in wall.items()}
        for name, seconds in medians.items():
            emit(
                metric="decode",
                dtype=name,
                batch=batch,
                median_step_ms=round(seconds * 1e3, 2),
                steps_per_s=round(1 / seconds, 2),
                tokens_per_s=round(batch / seconds, 1),
                median_cpu_ms=round(statistics.median(cpu[name]) * 1e3, 2),
            )
        emit(
            metric="decode_ratio",
            batch=batch,
            bfloat16_speedup=round(medians["float32"] / medians["bfloat16"], 3),
            load_average=os.getloadavg()[0],
        )


if __name__ == "__main__":
    main()
