"""The whole engine over the Triton attention backend (the CUDA path's kernels), on the
GPU where there is one, else on the CPU under Triton's interpreter: greedy tokens equal
the C++ backend's (on the CPU) through chunked prefill, prefix caching, copy-on-write of
forks and recompute preemption, and with blocks released behind a sliding window."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")

from tiny_checkpoints import run_token_ids, tiny_engine  # noqa: E402

import pagedllm.engine.model_worker as model_worker  # noqa: E402
from pagedllm.attention.triton_backend import TritonAttentionBackend  # noqa: E402
from pagedllm.engine.sampling_params import SamplingParams  # noqa: E402
from pagedllm.models.loader import load_model  # noqa: E402

pytestmark = pytest.mark.triton

TRITON_DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
"""Where the Triton kernels run: the GPU, else the CPU (under the interpreter, which the
tests' conftest turns on without CUDA)."""


def triton_backend_for(kv_cache, sdpa_min_rows=None):
    """The Triton backend where the engine would build the CPU one (under the
    interpreter on a CPU cache; the paged kernel's SDPA option does not apply)."""
    return TritonAttentionBackend(kv_cache)


def test_triton_backend_engine_matches_cpu_backend(tiny_model, monkeypatch):
    shared = list(range(100, 140))  # 40 tokens: 10 full blocks of 4 shared by the prompts
    prompts = [shared + [7, 8, 9], shared + [11] * 6, list(range(300, 323)), [5, 6]]
    params = SamplingParams(temperature=0.0, max_tokens=12, n=2, ignore_eos=True)
    # a pool small enough that the batch preempts, and a token budget that chunks prefills
    settings = dict(num_blocks=26, max_num_seqs=8, max_num_batched_tokens=16)
    expected = run_token_ids(tiny_engine(tiny_model, **settings), prompts, params)
    monkeypatch.setattr(model_worker, "attention_backend_for", triton_backend_for)
    engine = tiny_engine(load_model(str(tiny_model.source), device=TRITON_DEVICE), **settings)
    assert isinstance(engine.runner.attn, TritonAttentionBackend)
    got = run_token_ids(engine, prompts, params)
    assert got == expected
    stats = engine.get_stats()
    assert stats.prefix_cache_hits > 0
    assert stats.num_preemptions_total > 0


def test_triton_backend_engine_releases_blocks_out_of_the_window(tmp_path, monkeypatch):
    """A Mistral whose every layer slides over 16 tokens: blocks behind the window go
    back to the pool (null entries in the tables the kernels read), tokens unchanged."""
    from transformers_oracle import write_random_checkpoint

    write_random_checkpoint(tmp_path, "mistral", sliding_window=16)
    loaded = load_model(str(tmp_path))
    prompts = [list(range(30, 70)), [5, 6, 7]]
    params = SamplingParams(temperature=0.0, max_tokens=24, n=2, ignore_eos=True)
    settings = dict(num_blocks=40, max_num_seqs=8, max_num_batched_tokens=16)
    expected = run_token_ids(tiny_engine(loaded, **settings), prompts, params)
    monkeypatch.setattr(model_worker, "attention_backend_for", triton_backend_for)
    engine = tiny_engine(load_model(str(tmp_path), device=TRITON_DEVICE), **settings)
    assert engine.block_manager.sliding_window == 16
    assert run_token_ids(engine, prompts, params) == expected
    # the same run keeping every block peaks at 36 blocks of 4 tokens; a decoding
    # sequence holds at most ceil(16 / 4) + 1 = 5, the prefill chunk at most 9
    assert engine.get_stats().peak_blocks_used <= 9 + 3 * 5
