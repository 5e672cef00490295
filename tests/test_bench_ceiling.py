"""The throughput ceiling counts the matrix products a Llama decoder really runs."""

from __future__ import annotations

import torch
from torch.utils.flop_counter import FlopCounterMode
from transformers import LlamaConfig, LlamaForCausalLM

from pagedllm.bench import ceiling
from pagedllm.bench.ceiling import matmul_flops_per_token, workload_matmul_flops
from pagedllm.bench.workload import BenchRequest
from pagedllm.cpu.onednn import reorderable

CONFIG = {
    "hidden_size": 64,
    "intermediate_size": 96,
    "num_hidden_layers": 3,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "head_dim": 32,  # not hidden / heads: the count must use it
    "vocab_size": 200,
}


def test_flops_per_token_equal_torchs_count_of_a_forward_pass():
    model = LlamaForCausalLM(LlamaConfig(**CONFIG, attn_implementation="eager")).eval()
    tokens = 5
    with torch.no_grad(), FlopCounterMode(display=False) as counter:
        model(torch.arange(tokens)[None])
    counts = counter.get_flop_counts()["Global"]
    projections = sum(n for op, n in counts.items() if "mm" in str(op) and "bmm" not in str(op))
    per_token, head_row = matmul_flops_per_token(CONFIG)
    assert projections == tokens * (per_token + head_row)  # HF computes every row's logits


def test_workload_counts_each_output_tokens_head_row_and_feeds_back_all_but_the_last():
    per_token, head_row = matmul_flops_per_token(CONFIG)
    requests = [BenchRequest([1, 2, 3], 4), BenchRequest([5], 1)]
    through_layers = (3 + 4 - 1) + (1 + 1 - 1)
    expected = through_layers * per_token + 5 * head_row
    assert workload_matmul_flops(CONFIG, requests) == expected


def test_ceiling_rests_on_the_faster_gemm(monkeypatch):
    rates = {"dense": 1e11, "packed": 4e11}
    monkeypatch.setattr(ceiling, "gemm_rates", lambda dtype: rates)
    requests = [BenchRequest([1, 2, 3], 4), BenchRequest([5], 1)]
    record = ceiling.ceiling_record(CONFIG, requests, "float32")
    flops = workload_matmul_flops(CONFIG, requests)
    assert record["gemm_gflop_per_s"] == 400.0
    assert record["gflop_per_s_by_gemm"] == {"dense": 100.0, "packed": 400.0}
    assert record["max_output_tokens_per_s"] == 5 / (flops / 4e11)


def test_gemm_rates_time_every_gemm_the_build_has():
    from pagedllm.cpu.extension import avx512_kernels_available

    rates = ceiling.gemm_rates(torch.float32)
    expected = {"dense"} | ({"packed"} if avx512_kernels_available() else set())
    expected |= {"onednn"} if reorderable(torch.empty(1, 1)) else set()
    assert set(rates) == expected
    assert all(rate > 0 for rate in rates.values())
