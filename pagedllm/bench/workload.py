"""The deterministic synthetic workload every throughput comparison runs."""

from __future__ import annotations

import argparse
import random
from dataclasses import dataclass


@dataclass(frozen=True)
class BenchRequest:
    """Random prompt token ids and the exact number of tokens to generate."""

    prompt_token_ids: list[int]
    output_len: int


def synthetic_workload(
    num_requests: int = 64,
    seed: int = 0,
    prompt_len: tuple[int, int] = (32, 512),
    output_len: tuple[int, int] = (16, 256),
    vocab_size: int = 49152,
) -> list[BenchRequest]:
    """Requests with lengths uniform in the inclusive ranges, ids uniform in the vocab
    (ids below 16 avoided: they are special tokens in most vocabularies)."""
    rng = random.Random(seed)
    requests = []
    for _ in range(num_requests):
        length = rng.randint(*prompt_len)
        ids = [rng.randrange(16, vocab_size) for _ in range(length)]
        requests.append(BenchRequest(ids, rng.randint(*output_len)))
    return requests


def shared_prefix_workload(
    num_requests: int = 32,
    seed: int = 0,
    prefix_len: int = 1024,
    unique_len: tuple[int, int] = (32, 128),
    output_len: int = 32,
    vocab_size: int = 49152,
) -> list[BenchRequest]:
    """Requests that all start with one random ``prefix_len``-token prefix (a shared
    system prompt) followed by their own tokens, a length uniform in ``unique_len``."""
    rng = random.Random(seed)
    prefix = [rng.randrange(16, vocab_size) for _ in range(prefix_len)]
    return [
        BenchRequest(
            prefix + [rng.randrange(16, vocab_size) for _ in range(rng.randint(*unique_len))],
            output_len,
        )
        for _ in range(num_requests)
    ]


def length_range(text: str) -> tuple[int, int]:
    """``"MIN,MAX"`` as an inclusive range of token counts (an argparse ``type``)."""
    try:
        low, high = (int(part) for part in text.split(","))
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected MIN,MAX, got {text!r}") from None
    if not 1 <= low <= high:
        raise argparse.ArgumentTypeError(f"need 1 <= MIN <= MAX, got {text!r}")
    return low, high
